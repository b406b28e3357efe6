"""``det experiment`` (``det e``): create, inspect, stop and tidy experiments.

Listing, describing and creating reuse ``det-tasks experiment`` (det_cli/submission.py) and the
registry's commands; pause, activate, cancel and kill call flows/lifecycle.py with the full
experiment key (the flow-run UUID) that the short id names."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from det_cli.continue_verb import add_config_overrides, register_continue
from det_cli.ids import experiment_run, short_id
from det_cli.job_verbs import register_set_attributes
from det_cli.numbers import positive_number
from det_cli.submission import EXPERIMENT_DEPLOYMENT, FINAL_STATES, submit_options
from det_cli.unsupported import add_unsupported, refuse_flag
from det_tasks.errors import DetTasksError

__all__ = ["register"]

LIFECYCLE_VERBS = {
    "activate": ("activate", ("unpause",), "Activate a paused experiment in a new flow run"),
    "cancel": ("cancel", (), "checkpoint every trial at its next batch boundary, then end"),
    "pause": ("pause", (), "checkpoint every trial at its next batch boundary, then pause"),
    "kill": ("kill", (), "stop every trial at its next batch boundary, without a checkpoint"),
}

UNSUPPORTED = {
    "archive": "MLflow has no archive; `det experiment delete ID` soft-deletes its runs "
    "(restorable in MLflow until `mlflow gc`)",
    "unarchive": "MLflow has no archive; restore deleted runs with MlflowClient.restore_run",
    "move": "there are no workspaces or projects; experiments are grouped by MLflow "
    "experiment (the config's `name`)",
    "download-model-def": "the model code is the package the experiment's flow run names "
    "(its `package` parameter, an s3:// URI; `det experiment describe ID` links the run)",
}

UNSUPPORTED_SET = {
    "gc-policy": "set checkpoint_storage.save_* in the config; `det-tasks gc EXPERIMENT_NAME` "
    "applies the policy now",
    "log-retention": "logs live in Prefect; use the Prefect server's retention settings",
}


def _id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="EXPERIMENT_ID", help="8-hex short id or full UUID")


def register(sub: Any) -> None:
    exp = sub.add_parser("experiment", aliases=["e"], help="experiments (Prefect flow runs)")
    verbs = exp.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("list", aliases=["ls"], help="recent experiments, newest first")
    p.add_argument("--limit", type=int, default=20, help="how many (default 20)")
    p.set_defaults(func=cmd_list)
    p = verbs.add_parser("describe", help="an experiment's state and trials")
    _id(p)
    p.set_defaults(func=cmd_describe)
    p = verbs.add_parser("list-trials", aliases=["lt"], help="an experiment's trials")
    _id(p)
    p.set_defaults(func=cmd_list_trials)
    p = verbs.add_parser("list-checkpoints", aliases=["lc"], help="its checkpoints, in batch order")
    _id(p)
    p.add_argument("--best", type=int, metavar="N", help="only the best N validated ones")
    p.set_defaults(func=cmd_list_checkpoints)
    p = verbs.add_parser("logs", help="the experiment's flow-run logs")
    _id(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    p.set_defaults(func=cmd_logs)
    _register_create(verbs)
    register_continue(verbs)
    for verb, (function, aliases, text) in LIFECYCLE_VERBS.items():
        p = verbs.add_parser(verb, aliases=list(aliases), help=text)
        _id(p)
        p.set_defaults(func=cmd_lifecycle, lifecycle=function)
    p = verbs.add_parser("wait", help="wait until it ends; exit 0 only when it completed")
    _id(p)
    p.add_argument(
        "--polling-interval",
        type=positive_number("--polling-interval"),
        default=5.0,
        help="seconds (default 5)",
    )
    p.set_defaults(func=cmd_wait)
    _register_download(verbs)
    _register_set(verbs)
    _register_label(verbs)
    p = verbs.add_parser("delete", help="delete a finished experiment's runs")
    _id(p)
    p.add_argument("--yes", action="store_true", help="do not ask")
    p.set_defaults(func=cmd_delete)
    for verb, instead in UNSUPPORTED.items():
        add_unsupported(verbs, "experiment", verb, instead)


def _register_create(verbs: Any) -> None:
    p = verbs.add_parser("create", help="validate, ship MODEL_DIR and start the experiment")
    p.add_argument("config", type=Path, metavar="CONFIG_FILE")
    p.add_argument("model_dir", type=Path, metavar="MODEL_DEF")
    add_config_overrides(p, "config override, e.g. searcher.max_length.batches=10")
    submit_options(p, EXPERIMENT_DEPLOYMENT)  # -f/--follow, --deployment, --max-package-mb
    refuse_flag(
        p,
        ["-t", "--test", "--test-mode"],
        "run Determined's test mode (one training batch, one validation, one checkpoint) "
        "with `det-tasks run CONFIG MODEL_DIR --test`",
    )
    refuse_flag(
        p,
        ["--paused"],
        "an experiment starts when it is created; create it, then `det experiment pause ID`",
    )
    refuse_flag(p, ["--local"], "train in this process with `det-tasks run CONFIG MODEL_DIR`")
    refuse_flag(p, ["--template"], "there are no templates; put the fields in the config")
    refuse_flag(p, ["-g", "--git"], "git metadata is not recorded; commit and tag yourself")
    p.set_defaults(func=cmd_create)


def _register_download(verbs: Any) -> None:
    p = verbs.add_parser("download", help="download the best checkpoints")
    _id(p)
    p.add_argument("-o", "--output-dir", default="checkpoints", help="default: checkpoints")
    p.add_argument("--top-n", type=int, default=1, help="best checkpoints of the N best trials")
    p.add_argument("--sort-by", help="validation metric (default: the searcher's)")
    p.add_argument("--smaller-is-better", choices=["true", "false"], help="with --sort-by")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the paths")
    p.set_defaults(func=cmd_download)


def _register_set(verbs: Any) -> None:
    settings = verbs.add_parser("set", help="set the experiment's description or name")
    attrs = settings.add_subparsers(dest="attribute", required=True, metavar="ATTRIBUTE")
    p = attrs.add_parser("description", help="the run's description (MLflow note)")
    _id(p)
    p.add_argument("description")
    p.set_defaults(func=cmd_set_description)
    p = attrs.add_parser("name", help="the MLflow parent run's name")
    _id(p)
    p.add_argument("name")
    p.set_defaults(func=cmd_set_name)
    register_set_attributes(attrs)
    for attribute, instead in UNSUPPORTED_SET.items():
        add_unsupported(attrs, "experiment set", attribute, instead)


def _register_label(verbs: Any) -> None:
    label = verbs.add_parser("label", help="add or remove a label (an MLflow tag)")
    actions = label.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in ("add", "remove"):
        p = actions.add_parser(action, help=f"{action} a label")
        _id(p)
        p.add_argument("label")
        p.set_defaults(func=cmd_label, present=action == "add")


def cmd_create(args: argparse.Namespace) -> int:
    from det_cli.submission import cmd_experiment_create

    return cmd_experiment_create(args, shown_id=short_id)


def cmd_list(args: argparse.Namespace) -> int:
    """Determined's list, after settling the listed experiments whose flow is gone: a
    stopped stack left their flow runs Running (they show ERROR, not ACTIVE)."""
    from det_cli.submission import cmd_experiment_list, experiment_runs
    from flows.lifecycle import DEAD_HOLDER, settle_dead_holders
    from registry.cli import tracking_reader_from_env

    for key in settle_dead_holders(tracking_reader_from_env(), experiment_runs(args.limit)):
        print(
            f"experiment {short_id(key)}: {DEAD_HOLDER}; its flow run is Crashed now",
            file=sys.stderr,
        )
    return cmd_experiment_list(args, shown_id=short_id)


def cmd_describe(args: argparse.Namespace) -> int:
    """Determined's describe, after settling an experiment whose flow is gone (its flow run
    Crashed, as MLflow already says); ends with how to continue it, where it can be."""
    from det_cli.continue_verb import continue_hint
    from det_cli.submission import cmd_experiment_describe
    from flows.lifecycle import settle_dead_holders
    from flows.prefect_rest import read_flow_run
    from registry.cli import tracking_reader_from_env

    run = experiment_run(args.id)
    reader = tracking_reader_from_env()
    settle_dead_holders(reader, [run])
    code = cmd_experiment_describe(args, shown_id=short_id)
    hint = continue_hint(reader, read_flow_run(run.id))
    if hint:
        print(hint)
    return code


def _view(run: Any) -> Any:
    from registry.cli import tracking_reader_from_env
    from registry.experiments.view import describe_experiment_run

    view = describe_experiment_run(tracking_reader_from_env(), str(run.id))
    if view is None:
        raise DetTasksError(
            f"experiment {short_id(run.id)} has no MLflow runs yet (its flow run is "
            f"{_state(run)}); try again once it has started"
        )
    return view


def cmd_list_trials(args: argparse.Namespace) -> int:
    from det_cli.submission import print_trials

    run = experiment_run(args.id)
    print_trials(_view(run), label=lambda trial_id: f"{short_id(run.id)}/{trial_id}")
    return 0


def cmd_list_checkpoints(args: argparse.Namespace) -> int:
    from registry.cli import experiment_parent, print_checkpoints, tracking_reader_from_env

    run = experiment_run(args.id)
    client = tracking_reader_from_env()
    parent = experiment_parent(client, str(run.id))
    print_checkpoints(client, parent, best=args.best, batch_order=True)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from det_cli.submission import print_logs

    return print_logs(experiment_run(args.id).id, follow=args.follow)


def cmd_lifecycle(args: argparse.Namespace) -> int:
    from flows import lifecycle

    run = experiment_run(args.id)
    print(getattr(lifecycle, args.lifecycle)(str(run.id)))
    return 0


def _state(run: Any) -> str:
    """The experiment's state in Determined's words (ACTIVE, PAUSED, CANCELED...)."""
    from det_cli.submission import experiment_state

    return experiment_state(run)


def cmd_wait(args: argparse.Namespace) -> int:
    """Poll until the flow run ends (Determined's ``wait``): 0 when COMPLETED, 1 otherwise."""
    from flows.prefect_rest import read_flow_run

    run = experiment_run(args.id)
    while run.state not in FINAL_STATES:
        time.sleep(max(args.polling_interval, 0.1))
        run = read_flow_run(run.id)
    state = _state(run)
    print(f"Experiment {short_id(run.id)} terminated with state {state}")
    return 0 if state == "COMPLETED" else 1


def cmd_download(args: argparse.Namespace) -> int:
    """The best checkpoint of each of the ``--top-n`` best trials, to OUTPUT_DIR/UUID."""
    from registry.checkpoints.store import rank_by_metric
    from registry.cli import (
        cmd_download,
        experiment_parent,
        ranked_checkpoints,
        tracking_client_from_env,
    )

    if bool(args.sort_by) != bool(args.smaller_is_better):
        raise DetTasksError("--sort-by and --smaller-is-better go together: give both or neither")
    run = experiment_run(args.id)
    client = tracking_client_from_env()
    metric, ranked, rest = ranked_checkpoints(client, experiment_parent(client, str(run.id)))
    if args.sort_by:
        metric = args.sort_by
        ranked = rank_by_metric([*ranked, *rest], metric, args.smaller_is_better == "true")
    chosen: list[dict[str, Any]] = []
    for record in ranked:
        if len(chosen) < args.top_n and all(c["trial"] != record["trial"] for c in chosen):
            chosen.append(record)
    if not chosen:
        raise DetTasksError(
            f"experiment {short_id(run.id)} has no checkpoint with a validation of {metric!r}"
        )
    targets = [Path(args.output_dir) / str(record["uuid"]) for record in chosen]
    taken = [str(t) for t in targets if t.exists()]
    if taken:
        raise DetTasksError(f"{taken[0]} already exists; choose another --output-dir")
    for record, target in zip(chosen, targets, strict=True):
        if not args.quiet:
            value = (record.get("validation_metrics") or {}).get(metric)
            print(
                f"Checkpoint {record['uuid']}: {record['trial']}, batch "
                f"{record['steps_completed']}, {metric}={value}"
            )
        cmd_download(argparse.Namespace(uri=str(record["uri"]), dest=str(target)))
    return 0


def cmd_set_description(args: argparse.Namespace) -> int:
    from registry.cli import set_experiment_description, tracking_client_from_env

    run = experiment_run(args.id)
    set_experiment_description(tracking_client_from_env(), str(run.id), args.description)
    print(f"Set description of experiment {short_id(run.id)} to {args.description!r}")
    return 0


def cmd_set_name(args: argparse.Namespace) -> int:
    from registry.cli import set_experiment_name, tracking_client_from_env

    run = experiment_run(args.id)
    set_experiment_name(tracking_client_from_env(), str(run.id), args.name)
    print(f"Set name of experiment {short_id(run.id)} to {args.name!r}")
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    from registry.cli import set_experiment_label, tracking_client_from_env

    run = experiment_run(args.id)
    labels = set_experiment_label(tracking_client_from_env(), str(run.id), args.label, args.present)
    done = "Added" if args.present else "Removed"
    print(f"{done} label {args.label!r}; experiment {short_id(run.id)} labels: {labels}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete a finished experiment: its MLflow runs (soft), then its Prefect flow run."""
    from flows.deployment_runs import delete_flow_run
    from registry.cli import delete_experiment_runs, tracking_client_from_env

    run = experiment_run(args.id)
    shown = short_id(run.id)
    if run.state not in FINAL_STATES:
        raise DetTasksError(
            f"experiment {shown} is {_state(run)}; stop it first (`det experiment kill {shown}`)"
        )
    if not args.yes:
        if not sys.stdin.isatty():
            raise DetTasksError(f"deleting experiment {shown} needs --yes when not interactive")
        answer = input(f"Delete experiment {shown}'s MLflow runs and flow run? [y/N] ")
        if answer.strip().lower() not in {"y", "yes"}:
            print("Aborting experiment deletion.")
            return 1
    deleted = delete_experiment_runs(tracking_client_from_env(), str(run.id))
    delete_flow_run(run.id)
    print(
        f"Successfully deleted experiment {shown} ({deleted} MLflow runs, restorable until "
        "`mlflow gc`; checkpoint files on S3 are kept)"
    )
    return 0
