"""Which checkpoint a trial resumes from: the newest intact one. A corrupted or truncated
newest checkpoint (checksum mismatch, missing file) is reported and skipped in favour of the
previous one, instead of failing every retry of the trial on the same bad bytes."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.references import scheme_of
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.errors import CheckpointError
from det_tasks.pytorch.harness import open_checkpoint

__all__ = ["choose_resume_checkpoint"]


def choose_resume_checkpoint(
    store: CheckpointStore, candidates: str | Sequence[str] | None
) -> str | None:
    """The first of ``candidates`` (newest first) whose files match their checksums."""
    if candidates is None:
        return None
    references = [candidates] if isinstance(candidates, str) else list(candidates)
    if len(references) <= 1:
        # One checkpoint asked for: past a missing path, the loader's error stands.
        for reference in references:
            _refuse_missing_path(reference)
        return references[0] if references else None
    problems = []
    for reference in references:
        try:
            _refuse_missing_path(reference)
            with open_checkpoint(store, reference) as path:
                # A sealed checkpoint is intact when its listed files are (a Core API
                # script's has no state_dict.pth); an unsealed one (Determined's) needs it.
                if not ckpt.verify(path).get("files"):
                    ckpt.find_state_file(path)
        except CheckpointError as err:
            problems.append(f"{reference}: {err}")
            print(
                f"warning: checkpoint {reference} is unusable ({err}); trying the previous one",
                file=sys.stderr,
            )
            continue
        return reference
    raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(problems))


def _refuse_missing_path(reference: str) -> None:
    """A reference written as a path (``./x``, ``../x``, ``/x``, ``~/x``, ``a/b``) names a
    directory, never a uuid in the store: if it is not there, say so in the user's words
    rather than looking it up as a uuid under the store's root."""
    if scheme_of(reference) is not None or os.path.exists(os.path.expanduser(reference)):
        return
    if reference.startswith((".", "~")) or "/" in reference or os.sep in reference:
        raise CheckpointError(
            f"checkpoint path {reference!r} does not exist: give an existing checkpoint "
            "directory, a checkpoint uuid, or a runs:/, models:/ or s3:// URI"
        )
