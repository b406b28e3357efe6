"""``det``'s parser and dispatch: Determined's nouns and verbs, one-line errors, the master."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from det_cli import experiment_verbs, registry_verbs, trial_verbs
from det_cli.job_verbs import register_job_verbs
from det_cli.master import use_master
from det_cli.submission import JOB_DEPLOYMENT, submit_options
from det_cli.unsupported import EXIT_UNSUPPORTED, Unsupported, add_unsupported
from det_tasks.errors import DetTasksError

__all__ = ["build_parser", "command", "main"]

UNSUPPORTED_NOUNS = {
    "notebook": "use Jupyter next to the stack; `det-tasks run` trains in-process",
    "shell": "run commands on the worker host directly",
    "command": "run a script as a job: `det job run CONFIG DIR` (entrypoint: script)",
    "cmd": "run a script as a job: `det job run CONFIG DIR` (entrypoint: script)",
    "tensorboard": "metrics are in MLflow: open MLFLOW_TRACKING_URI in a browser",
    "agent": "workers are Prefect and Dask workers: `prefect worker ls`, the Dask dashboard",
    "slot": "workers are Prefect workers and Dask workers: see the Dask dashboard",
    "resources": "see the Prefect UI's work pools and the Dask dashboard",
    "user": "users are the MLflow and Prefect servers' own (MLFLOW_TRACKING_USERNAME, "
    "PREFECT_API_AUTH_STRING)",
    "workspace": "there are no workspaces; experiments are grouped by MLflow experiment",
    "project": "there are no projects; experiments are grouped by MLflow experiment",
    "template": "there are no templates; put the fields in the config",
    "master": "the master is the Prefect server: `prefect config view`, `make status`",
    "task": "tasks are Prefect task runs: see the Prefect UI",
    "deploy": "start the platform with `make up`",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        print(f"det: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_UNSUPPORTED)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="det",
        description="Determined's CLI over this platform (Prefect, MLflow, S3).",
    )
    parser.add_argument(
        "-m",
        "--master",
        help="the platform's Prefect server, HOST[:PORT] or its URL (default: DET_MASTER, "
        "then PREFECT_API_URL, then .stack/env)",
    )
    sub = parser.add_subparsers(dest="noun", required=True, metavar="COMMAND", parser_class=_Parser)
    experiment_verbs.register(sub)
    trial_verbs.register(sub)
    registry_verbs.register(sub)
    job = sub.add_parser("job", help="the shared cluster's job queue, and batch jobs")
    verbs = job.add_subparsers(dest="verb", required=True, metavar="VERB")
    register_job_verbs(verbs)
    run = verbs.add_parser("run", help="validate, ship MODEL_DIR and start a batch job")
    run.add_argument("config", type=Path)
    run.add_argument("model_dir", type=Path)
    submit_options(run, JOB_DEPLOYMENT)
    run.set_defaults(func=_job_run)
    for noun, instead in UNSUPPORTED_NOUNS.items():
        add_unsupported(sub, "", noun, instead)
    return parser


def _job_run(args: argparse.Namespace) -> int:
    from det_cli.submission import cmd_job_run

    return cmd_job_run(args)


def _note_real_determined() -> None:
    """A `determined` distribution next to this one installs a `det` too (the last install
    wins the script): say which one this is and how to reach the other."""
    try:
        version = importlib.metadata.version("determined")
    except importlib.metadata.PackageNotFoundError:
        return
    print(
        f"note: this `det` is det-tasks' (Prefect/MLflow platform); Determined {version}'s "
        "CLI is `python -m determined.cli`",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    _note_real_determined()
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "platform", True):
            use_master(args.master)
        return int(args.func(args))
    except Unsupported as err:
        print(f"det: {err}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except DetTasksError as err:
        print(f"det: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def command() -> NoReturn:
    """The ``det`` executable: ``main`` with the command line, then exit without the
    interpreter's last garbage collections (0.25 s of every command's exit, with Prefect
    loaded). No user code runs in this process, so nothing waits on a collection."""
    code = main()
    from flows.quiet_shutdown import exit_without_final_collection

    exit_without_final_collection(code)
