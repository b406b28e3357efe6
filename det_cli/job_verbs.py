"""``det job list`` and ``det job update``, and ``det experiment set priority|weight|
max-slots``: the shared cluster's queue (cluster.job_queue), read and changed through the
stack's Dask scheduler. A job is an experiment; its id is the experiment's short id."""

from __future__ import annotations

import argparse
import datetime
import math
from typing import Any

from cluster.environment import stack_scheduler
from det_tasks.errors import DetTasksError

__all__ = [
    "cmd_job_list",
    "cmd_job_update",
    "cmd_set_job_setting",
    "register_job_verbs",
    "register_set_attributes",
]

# `det experiment set ATTRIBUTE`: the job setting each one changes.
SET_ATTRIBUTES = {"priority": "priority", "weight": "weight", "max-slots": "max_slots"}


def register_job_verbs(verbs: Any) -> None:
    """``list`` and ``update`` under ``det job``."""
    p = verbs.add_parser("list", aliases=["ls"], help="the shared cluster's queue of jobs")
    p.set_defaults(func=cmd_job_list)
    p = verbs.add_parser("update", help="change a job's priority or weight")
    p.add_argument("id", help="the job (experiment) id, as `det job list` shows it")
    p.add_argument("--priority", type=_priority, help="1 (most urgent) to 99")
    p.add_argument("--weight", type=_weight, help="its fair share against others, > 0")
    p.set_defaults(func=cmd_job_update)


def register_set_attributes(attrs: Any) -> None:
    """``det experiment set priority|weight|max-slots ID VALUE``."""
    kinds = {"priority": _priority, "weight": _weight, "max-slots": _max_slots}
    for attribute, kind in kinds.items():
        p = attrs.add_parser(attribute, help=f"the experiment's {attribute} in the job queue")
        p.add_argument("id")
        p.add_argument("value", type=kind)
        p.set_defaults(func=cmd_set_job_setting, setting=SET_ATTRIBUTES[attribute])


def cmd_job_list(args: argparse.Namespace) -> int:
    from cluster.job_requests import list_jobs
    from registry.cli import print_table

    jobs = _ask(list_jobs)
    rows = [
        [
            job["position"] or "",
            job["key"][:8],
            "EXPERIMENT",
            job["name"],
            job["state"],
            job["priority"],
            f"{job['weight']:g}",
            f"{job['held']}/{job['wanted']}",
            "" if job["max_slots"] is None else job["max_slots"],
            job["pool"],
            _when(job["submitted"]),
            job["user"],
        ]
        for job in jobs
    ]
    header = ["#", "id", "type", "job name", "state", "priority", "weight"]
    header += ["slots", "max slots", "pool", "submitted", "user"]
    if any("slurm_jobs" in job for job in jobs):  # workers are Slurm jobs (cluster.slurm_workers)
        header.append("slurm jobs")
        for row, job in zip(rows, jobs, strict=True):
            row.append(",".join(job.get("slurm_jobs", ())))
    print_table(rows, header)
    for job in jobs:
        if job["state"] == "QUEUED" and job["reason"]:
            print(f"{job['key'][:8]}: {job['reason']}")
    return 0


def cmd_job_update(args: argparse.Namespace) -> int:
    settings = {
        name: value
        for name, value in (("priority", args.priority), ("weight", args.weight))
        if value is not None
    }
    if not settings:
        raise DetTasksError("det job update: give --priority N and/or --weight W")
    return _update(args.id, settings)


def cmd_set_job_setting(args: argparse.Namespace) -> int:
    return _update(args.id, {args.setting: args.value})


def _update(ident: str, settings: dict[str, Any]) -> int:
    from cluster.job_requests import update_job

    key = ident.strip().lower()
    answer = _ask(lambda address: update_job(address, key, **settings))
    if "error" in answer:
        raise DetTasksError(f"det job: {answer['error']}; see `det job list`")
    now = ", ".join(f"{k}={v}" for k, v in answer["settings"].items())
    print(f"job {answer['key'][:8]}: {now} (in force at the queue's next decision)")
    return 0


def _ask(call: Any) -> Any:
    why = "the job queue lives on the stack's Dask scheduler (source .stack/env after make up)"
    with stack_scheduler(why) as address:
        try:
            return call(address)
        except OSError:
            raise  # stack_scheduler says it cannot be reached
        except Exception as err:  # it answered, but cannot run the queue (no det-tasks there)
            raise DetTasksError(
                f"the Dask scheduler at {address} cannot run the job queue "
                f"({type(err).__name__}: {err}); install det-tasks where it runs"
            ) from None


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _priority(text: str) -> int:
    value = _number(text, int, "priority")
    if not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"priority {text} is not in 1..99 (1 is most urgent)")
    return value


def _weight(text: str) -> float:
    value = _number(text, float, "weight")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"weight {text} must be greater than 0")
    return value


def _max_slots(text: str) -> int:
    value = _number(text, int, "max-slots")
    if value < 1:
        raise argparse.ArgumentTypeError(f"max-slots {text} must be at least 1")
    return value


def _number(text: str, kind: Any, name: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number") from None
    if not math.isfinite(value):  # float("nan") and float("inf") parse; shares need numbers
        raise argparse.ArgumentTypeError(f"{name} {text!r} is not a finite number, e.g. 2")
    return value
