"""Which frames of a traceback are the user's code: not det_tasks, not a package plugged
into it (registry, flows), not an installed library. Errors point there, and only there."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import traceback
from functools import lru_cache
from pathlib import Path

__all__ = ["UserFrame", "innermost_user_frame", "user_traceback"]


@dataclasses.dataclass(frozen=True)
class UserFrame:
    function: str  # e.g. train_batch
    location: str  # file:line, relative to the working directory when inside it


def _user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    platform = _platform_packages()
    ours = Path(__file__).resolve().parent
    libraries = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found = []
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        path = Path(name).resolve() if not name.startswith("<") else None
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if (
            path is not None
            and module.partition(".")[0] not in platform
            and not path.is_relative_to(ours)
            and not any(path.is_relative_to(lib) for lib in libraries)
        ):
            found.append(
                traceback.FrameSummary(str(path), tb.tb_lineno, tb.tb_frame.f_code.co_name)
            )
        tb = tb.tb_next
    return found


def _shown(path: str, base: Path | None) -> str:
    """``path`` relative to ``base`` (default: the working directory) when inside it."""
    base = (base or Path.cwd()).resolve()
    resolved = Path(path)
    return str(resolved.relative_to(base)) if resolved.is_relative_to(base) else path


def innermost_user_frame(err: BaseException, base: Path | None = None) -> UserFrame | None:
    """The user's frame nearest to where ``err`` was raised, or None; its file is shown
    relative to ``base`` (the model directory, say; default the working directory)."""
    frames = _user_frames(err)
    if not frames:
        return None
    last = frames[-1]
    return UserFrame(last.name, f"{_shown(last.filename, base)}:{last.lineno}")


def user_traceback(err: BaseException, base: Path | None = None) -> str:
    """``err``'s traceback with only the user's frames (empty when it has none)."""
    frames = _user_frames(err)
    if not frames:
        return ""
    summary = traceback.StackSummary.from_list(
        [traceback.FrameSummary(_shown(f.filename, base), f.lineno, f.name) for f in frames]
    )
    lines = ["Traceback (the trial's code only):\n", *summary.format()]
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines).rstrip("\n")


@lru_cache(maxsize=1)
def _platform_packages() -> frozenset[str]:
    """det_tasks and the packages plugged into it through its entry points (registry,
    flows): their frames are the platform's, never the user's code to point at."""
    names = {"det_tasks"}
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points:
            if entry.group.startswith("det_tasks."):
                names.add(entry.module.partition(".")[0])
    return frozenset(names)
