"""``python -m det_tasks.runner.script SCRIPT [ARGS...]``: run a Determined-style script
(``import determined as det``; ``det.pytorch.init()``) as ``__main__`` in a process of its
own, with the ``determined`` alias installed. Batch jobs (``det-tasks job run``) use it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m det_tasks.runner.script SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    from det_tasks import compat

    compat.install()
    script = Path(args[0]).resolve()
    if not script.is_file():
        print(f"error: script {args[0]!r} not found in {str(Path.cwd())!r}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *args[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
