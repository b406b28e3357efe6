"""A checkpoint that could not be written for lack of space, said in one line.

One wording for every writer of checkpoints (``det-tasks run``'s background writer, a flow's
held trial, the local-files object store): what is full, that nothing partial was published,
which checkpoint is the last good one, and what to do. A full disk is not the trial's fault
and a retry meets it again, so whoever runs the trial stops it resumably (the flow pauses the
experiment) instead of failing it.

``shutil.copytree`` reports a full disk as ``shutil.Error`` whose one argument is a list of
``(src, dst, "[Errno 28] No space left on device: ...")`` tuples, its ``errno`` unset: such a
list once became a 1,008-character last line. It is recognised here too.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from det_tasks.errors import CheckpointError, StepFailed

__all__ = [
    "UNKNOWN_FOLDER",
    "CheckpointSpaceFull",
    "NoRoomForCheckpoint",
    "no_space",
    "os_error_in",
    "os_error_text",
]

UNKNOWN_FOLDER = "the checkpoint storage"  # a full disk whose path the error did not name

# No space, and a quota reached: both mean "free room, then continue".
_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointSpaceFull(CheckpointError):
    """No room to write a checkpoint: ``folder`` is full; ``previous`` is the last good
    checkpoint (None: none yet, or not known where this was raised)."""

    def __init__(
        self, folder: str, batch: int | None = None, previous: str | None = None, why: str = ""
    ) -> None:
        self.folder, self.batch, self.previous = folder, batch, previous
        self.why = why or os.strerror(errno.ENOSPC)
        at = f" at batch {batch}" if batch is not None else ""
        kept = (
            f"the previous checkpoint ({previous}) is intact"
            if previous
            else "earlier checkpoints are intact"
        )
        super().__init__(
            f"the checkpoint{at} was not written: {folder} is full ({self.why}); nothing was "
            f"published and {kept}. Free space or point checkpoint_storage elsewhere"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:  # crosses processes whole
        return (CheckpointSpaceFull, (self.folder, self.batch, self.previous, self.why))


class NoRoomForCheckpoint(StepFailed):
    """A trial's step stopped because its checkpoint found no room (``folder`` is full):
    not retried (a retry meets the same full disk); the trial ends PAUSED, resumable from
    its last good checkpoint once there is room. Plain data, so it crosses Dask whole."""

    def __init__(
        self, trial_id: int | str, batch: int, folder: str, why: str, attempts: int = 1
    ) -> None:
        self.folder, self.why = folder, why
        super().__init__(trial_id, "checkpoint", batch, why, retryable=False, attempts=attempts)

    def _text(self) -> str:
        return (
            f"trial {self.trial_id} stopped at batch {self.batch}: {self.folder} is full "
            f"({self.why}); nothing partial was left"
        )

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        args = (self.trial_id, self.batch, self.folder, self.why, self.attempts)
        return (NoRoomForCheckpoint, args)

    def after_attempts(self, attempts: int) -> NoRoomForCheckpoint:
        return NoRoomForCheckpoint(self.trial_id, self.batch, self.folder, self.why, attempts)


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind ``err`` (itself, or its cause/context chain), if any; one that
    says the disk is full is preferred over others in the chain."""
    errors = list(_chain(err))
    os_errors = [e for e in errors if isinstance(e, OSError)]
    full = next((e for e in os_errors if _full_errno(e) is not None), None)
    return full or (os_errors[0] if os_errors else None)


def no_space(err: BaseException) -> CheckpointSpaceFull | None:
    """``err`` as a CheckpointSpaceFull if a full disk is behind it (anywhere in its
    chain, or in a shutil.Error's list), else None."""
    for current in _chain(err):
        if isinstance(current, CheckpointSpaceFull):
            return current
    for current in _chain(err):
        if isinstance(current, OSError):
            found = _full_errno(current)
            if found is not None:
                return CheckpointSpaceFull(_folder_of(found[1]), why=os.strerror(found[0]))
    return None


def os_error_text(err: OSError) -> str:
    """What went wrong, short: the error's own words (for a shutil.Error, its first failed
    file's, and how many failed), never the raw list of tuples."""
    full = _full_errno(err)
    if full is not None:
        return os.strerror(full[0])
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
        entries = [e for e in err.args[0] if isinstance(e, tuple) and len(e) == 3]
        if entries:
            more = f" (and {len(entries) - 1} more files)" if len(entries) > 1 else ""
            return f"{entries[0][1]}: {entries[0][2]}{more}"
    return err.strerror or str(err)


def _chain(err: BaseException) -> list[BaseException]:
    seen: set[int] = set()
    out: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _full_errno(err: OSError) -> tuple[int, str | None] | None:
    """(errno, the path it happened at) when ``err`` says the disk is full."""
    if err.errno in _FULL:
        return int(err.errno), err.filename if isinstance(err.filename, str) else None
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
        for entry in err.args[0]:
            if not (isinstance(entry, tuple) and len(entry) == 3):
                continue
            for number in _FULL:
                if f"[Errno {number}]" in str(entry[2]):
                    return number, str(entry[1])
    return None


def _folder_of(path: str | None) -> str:
    """The folder a failed write was in, past the temporary folders a publish writes
    through (``.upload-*``, ``.staging``); "the checkpoint storage" when unknown."""
    if not path:
        return UNKNOWN_FOLDER
    folder = Path(path).parent
    while folder.name.startswith(".") and folder.parent != folder:
        folder = folder.parent
    return str(folder)
