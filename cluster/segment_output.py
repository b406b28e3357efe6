"""What a failed segment process (``det-tasks run``, or torchrun/horovodrun around it)
printed last, as the one message a user reads: the ranks' own lines, without the launcher's
traceback that sits between them and its summary."""

from __future__ import annotations

import re

__all__ = ["last_output"]

_TORCHRUN_SUMMARY = re.compile(r"^\S+ FAILED$")


_TORCHRUN_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def last_output(stderr: str, lines: int = 20) -> str:
    """A failed trial process's last ``lines`` lines. torchrun ends its output with its own
    traceback and a summary that name the rank that failed first but not its error, so the
    ``lines`` before them (the rank's own traceback) come first."""
    out = stderr.splitlines()
    for i in range(len(out) - 2, -1, -1):
        if _TORCHRUN_SUMMARY.match(out[i]) and out[i + 1].startswith("-----"):
            end = _before_torchruns_traceback(out, i)
            return "\n".join([*out[max(0, end - lines) : end], *out[i:][-lines:]])
    return "\n".join(out[-lines:])


def _before_torchruns_traceback(out: list[str], summary: int) -> int:
    """Where torchrun's own traceback (ending in ChildFailedError, 18 lines) starts above its
    summary: its header, found only right above its indented frame lines (so a rank's own
    traceback further up is never taken for it); the top of those frames without a header;
    or the summary's line if there is no such traceback."""
    for j in range(summary - 1, max(-1, summary - 60), -1):
        if out[j].startswith(_TORCHRUN_ERROR):
            k = j - 1
            while k >= 0 and out[k].startswith("  "):  # frames, code and ^^^ markers
                k -= 1
            return k if k >= 0 and out[k] == "Traceback (most recent call last):" else k + 1
    return summary
