"""Which frames of a traceback are the user's code: not the platform (det_tasks and every
package installed with it: cluster, flows, registry, ...), not an installed library. Errors
point there, and only there.

An exception a DataLoader worker process raised reaches the trial's process as text
(``det_tasks.loader_failures``): its frames are read back from that text, so the user's
``__getitem__`` is the innermost user frame, not a platform frame that iterated the loader.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import linecache
import sys
import traceback
from functools import lru_cache
from pathlib import Path
from types import TracebackType

from det_tasks.errors import DetTasksError
from det_tasks.loader_failures import loader_worker_death, worker_traceback

__all__ = ["UserFrame", "error_text", "innermost_user_frame", "user_traceback"]


@dataclasses.dataclass(frozen=True)
class UserFrame:
    function: str  # e.g. train_batch
    location: str  # file:line, relative to the working directory when inside it
    record: int | None = None  # __getitem__'s index, where it is known

    @property
    def described(self) -> str:
        """The function, with the record it was loading where known: ``__getitem__
        (record 3)``."""
        return self.function + (f" (record {self.record})" if self.record is not None else "")


def _is_user_path(path: Path, module: str | None = None) -> bool:
    """Whether a frame's file (and module, when known) is the user's, not the platform's
    nor an installed library's."""
    if module is not None and module.partition(".")[0] in _platform_packages():
        return False
    return not any(path.is_relative_to(root) for root in _not_user_roots())


def _live_user_frames(err: BaseException) -> list[tuple[traceback.FrameSummary, int | None]]:
    """The user's frames of ``err``'s own traceback, each with its record index (the
    innermost ``__getitem__``'s) where it has one."""
    found = []
    tb: TracebackType | None = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if not name.startswith("<") and _is_user_path(Path(name).resolve(), module):
            frame = traceback.FrameSummary(
                str(Path(name).resolve()), tb.tb_lineno, tb.tb_frame.f_code.co_name
            )
            found.append((frame, _record_index(tb)))
        tb = tb.tb_next
    return found


def _record_index(tb: TracebackType) -> int | None:
    """The index a ``__getitem__`` frame was called with (its first argument after self)."""
    code = tb.tb_frame.f_code
    if code.co_name != "__getitem__" or code.co_argcount < 2:
        return None
    index = tb.tb_frame.f_locals.get(code.co_varnames[1])
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _user_frames(err: BaseException) -> list[tuple[traceback.FrameSummary, int | None]]:
    """The user's frames, outermost first: this process's, then (innermost) those of the
    DataLoader worker the exception came from."""
    frames = _live_user_frames(err)
    worker = worker_traceback(err)
    if worker is not None:
        for frame in worker.frames:
            if not frame.filename.startswith("<") and _is_user_path(Path(frame.filename)):
                frames.append((frame, None))
    return frames


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
    last, record = frames[-1]
    return UserFrame(last.name, f"{_shown(last.filename, base)}:{last.lineno}", record)


def error_text(err: BaseException) -> str:
    """The error in the user's terms: a DataLoader worker's own exception line (not torch's
    wrapper with the worker's traceback as text), or the signal that killed a DataLoader
    worker and its likely cause; else ``Type: message`` (a platform error: its message)."""
    death = loader_worker_death(err)
    if death is not None:
        return death
    worker = worker_traceback(err)
    if worker is not None:
        return f"{worker.error} (in DataLoader worker process {worker.worker})"
    return str(err) if isinstance(err, DetTasksError) else f"{type(err).__name__}: {err}"


def user_traceback(err: BaseException, base: Path | None = None) -> str:
    """``err``'s traceback with only the user's frames (empty when it has none)."""
    frames = _user_frames(err)
    if not frames:
        return ""
    summary = traceback.StackSummary.from_list(
        [
            traceback.FrameSummary(
                _shown(f.filename, base),
                f.lineno,
                f.name,
                line=linecache.getline(f.filename, f.lineno or 0).strip(),
            )
            for f, _ in frames
        ]
    )
    lines = ["Traceback (the trial's code only):\n", *summary.format()]
    record = frames[-1][1]
    if record is not None:
        lines.append(f"  (record index {record})\n")
    if worker_traceback(err) is not None or loader_worker_death(err) is not None:
        lines.append(error_text(err) + "\n")
    else:
        lines += traceback.format_exception_only(type(err), err)
    return "".join(lines).rstrip("\n")


# pyproject.toml's packages: the platform even where it runs from a checkout on PYTHONPATH,
# not installed (then no distribution names them).
_PROJECT_PACKAGES = ("det_tasks", "registry", "cluster", "searchers", "flows", "det_cli", "infra")


@lru_cache(maxsize=1)
def _platform_packages() -> frozenset[str]:
    """det_tasks, every package installed with it (cluster, flows, registry, ...) and the
    packages plugged into it through its entry points: their frames are the platform's,
    never the user's code to point at."""
    names = set(_PROJECT_PACKAGES)
    ours = importlib.metadata.packages_distributions().get("det_tasks", [])
    for top, distributions in importlib.metadata.packages_distributions().items():
        if set(distributions) & set(ours):
            names.add(top)
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points:
            if entry.group.startswith("det_tasks."):
                names.add(entry.module.partition(".")[0])
    return frozenset(names)


@lru_cache(maxsize=1)
def _not_user_roots() -> tuple[Path, ...]:
    """Folders whose files are never the user's: the platform's packages, the Python
    installation and its site-packages (a frame read from text has no module name)."""
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for name in _platform_packages():
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.add(Path(location).resolve())
    return tuple(roots)
