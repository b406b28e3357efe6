"""The stack's process work pool, whose flow runs start Prefect's engine in one interpreter.

When a process pool's job template names no command, Prefect 3.8's worker starts each flow
run as two interpreters one after the other: a workspace supervisor that imports Prefect
and runs the deployment's pull step, then ``python -m prefect.engine``, which imports
Prefect again. The stack's pool names :func:`engine_command` as its default command:
``python -m flows.engine_session``, Prefect's engine in a session of its own with a guard
for what it starts (see that module), which runs the pull step itself as it loads the flow.
One interpreter start less between the worker's pickup and the flow's first line.

The command names the interpreter that runs this module, the one ``infra`` starts the
pool's workers with, so the flow runs in the worker's installation. A deployment's own
``command`` job variable still wins. ``python -m flows.work_pool NAME`` creates the pool,
or brings an existing one's template to this (``infra.stack`` runs it; ``infra`` itself
imports no Prefect).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from typing import Any

__all__ = ["engine_command", "process_pool_template", "ensure_process_pool"]


def engine_command(python: str = sys.executable) -> str:
    """The flow run's command: Prefect's engine in ``python``, in a session of its own
    (``flows.engine_session``), with no supervisor before it."""
    return shlex.join([python, "-m", "flows.engine_session"])


def process_pool_template(python: str = sys.executable) -> dict[str, Any]:
    """Prefect's own base job template for process pools, its ``command`` defaulting to
    :func:`engine_command` instead of none."""
    from prefect.workers.process import ProcessWorker

    template = copy.deepcopy(ProcessWorker.get_default_base_job_template())
    template["variables"]["properties"]["command"]["default"] = engine_command(python)
    return template


def ensure_process_pool(name: str, python: str = sys.executable) -> None:
    """Create the process pool ``name`` with :func:`process_pool_template`, or update an
    existing one's template to it (one request when it does not exist yet)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = WorkPoolCreate(
        name=name, type="process", base_job_template=process_pool_template(python)
    )
    with get_client(sync_client=True) as client:
        client.create_work_pool(work_pool=pool, overwrite=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the work pool's name")
    parser.add_argument("--python", default=sys.executable, help="the flow runs' interpreter")
    args = parser.parse_args(argv)
    ensure_process_pool(args.name, args.python)


if __name__ == "__main__":
    main()
