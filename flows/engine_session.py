"""A flow run's process, as the stack's work pool starts it: Prefect's engine, in one
interpreter, in a session of its own, with a guard for what it starts.

Left to itself, Prefect 3.8's process worker starts each flow run as two interpreters one
after the other: its workspace supervisor (``prefect.runner._workspace_supervisor``), which
imports Prefect, runs the deployment's pull step, moves to a session of its own and then
``exec``s ``python -m prefect.engine``, which imports Prefect again (1.1-1.2 s of the time to
the first batch on an idle 2-core VM, docs/performance.md). With a ``command`` in the pool's
job template, the worker starts that command alone, and the engine runs the pull step
itself as it loads the flow; but in the worker's own process group, and a cancel then
signals its pid alone. ``python -m flows.engine_session``, the command ``flows.work_pool``
gives the stack's pool, keeps what the supervisor gave and drops the second start:

- **a session of its own** (``os.setsid``): stopping the worker (``make down``, a SIGTERM
  to its group) does not take the flow runs it started, which wait for the services and
  train on, as they did under the supervisor;
- **what the flow run starts ends with it**: everything it starts carries its mark in the
  environment (``det_tasks.runner.trial_processes``), and a guard process
  (``det_tasks.runner.trial_guard``, the one that ends a killed trial runner's processes)
  ends what is left once this process is gone, by a cancel's SIGTERM, a SIGKILL or a normal
  exit. Under the supervisor, the worker's cancel signalled the whole process group;
- **the engine keeps the worker's pid**: Prefect's engine runs in this very process (as
  ``python -m prefect.engine`` would), so the worker's signals, its control channel and the
  exit status are the engine's, with nothing between them.

The guard gets the environment without Prefect's flow-run variables: the flow run's
process is the one process that carries ``PREFECT__FLOW_RUN_ID``. It watches from its own
start on (an interpreter start, about 0.1 s idle): a flow run killed before that has
started nothing yet that it would have to end.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

__all__ = ["ENGINE_MODULE", "enter_own_session", "guard_what_this_process_starts", "main"]

ENGINE_MODULE = "prefect.engine"


def enter_own_session() -> None:
    """Leave the starter's session and process group; where this process already leads its
    group (started by hand from a shell, which gave it a group of its own), stay in it."""
    with contextlib.suppress(PermissionError):
        os.setsid()


def guard_what_this_process_starts() -> None:
    """Mark what this process starts from now on, and start the guard that ends it once this
    process is gone."""
    from det_tasks.runner.trial_processes import mark_what_this_process_starts, start_guard

    mark = mark_what_this_process_starts()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")}
    start_guard(mark, env)


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.engine_session [MODULE]``: run MODULE (Prefect's engine) as
    ``python -m MODULE`` would, in a session of its own, with a guard."""
    args = sys.argv[1:] if argv is None else argv
    module = args[0] if args else ENGINE_MODULE
    enter_own_session()
    guard_what_this_process_starts()
    sys.argv = [sys.argv[0], *args[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
