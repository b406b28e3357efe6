"""``det trial`` (``det t``): one trial of an experiment, named ``EXPERIMENT/N`` or by its
MLflow run id."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from det_cli.ids import experiment_run, parse_trial_ref, short_id
from det_cli.unsupported import add_unsupported
from det_tasks.errors import DetTasksError

__all__ = ["ResolvedTrial", "register", "resolve_trial"]

UNSUPPORTED = {
    "download": "trial checkpoints: `det experiment list-checkpoints ID`, then "
    "`det checkpoint download UUID`",
    "set-log-retention": "logs live in Prefect; use the Prefect server's retention settings",
}


def register(sub: Any) -> None:
    trial = sub.add_parser("trial", aliases=["t"], help="one trial: EXPERIMENT/N")
    verbs = trial.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = verbs.add_parser("describe", help="its state, progress, best metric and hparams")
    p.add_argument("trial", metavar="TRIAL_ID", help="EXPERIMENT/N or an MLflow run id")
    p.set_defaults(func=cmd_describe)
    p = verbs.add_parser("logs", help="the logs of its train/validate/checkpoint tasks")
    p.add_argument("trial", metavar="TRIAL_ID")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    p.set_defaults(func=cmd_logs)
    p = verbs.add_parser("kill", help="kill the trial (the experiment, when it is its only one)")
    p.add_argument("trial", metavar="TRIAL_ID")
    p.set_defaults(func=cmd_kill)
    for verb, instead in UNSUPPORTED.items():
        add_unsupported(verbs, "trial", verb, instead)


@dataclasses.dataclass(frozen=True)
class ResolvedTrial:
    flow_run: Any
    view: Any  # registry.experiments.view.ExperimentView
    trial: Any  # registry.experiments.view.TrialView

    @property
    def label(self) -> str:
        return f"{short_id(self.flow_run.id)}/{self.trial.trial_id}"


def resolve_trial(text: str) -> ResolvedTrial:
    from registry.cli import experiment_key_of_trial_run, tracking_reader_from_env
    from registry.experiments.view import describe_experiment_run

    ref = parse_trial_ref(text)
    client = tracking_reader_from_env()
    if ref.mlflow_run_id is not None:
        key = experiment_key_of_trial_run(client, ref.mlflow_run_id)
        flow_run = experiment_run(key)
    else:
        assert ref.experiment is not None
        flow_run = experiment_run(ref.experiment)
    view = describe_experiment_run(client, str(flow_run.id))
    trials = view.trials if view else []
    found = [t for t in trials if t.run_id == ref.mlflow_run_id or t.trial_id == ref.number]
    if not found:
        numbers = ", ".join(t.trial_id for t in trials) or "none yet"
        raise DetTasksError(
            f"experiment {short_id(flow_run.id)} has no trial {text!r} (its trials: {numbers})"
        )
    return ResolvedTrial(flow_run, view, found[0])


def cmd_describe(args: argparse.Namespace) -> int:
    from registry.cli import tracking_reader_from_env, trial_hparams

    resolved = resolve_trial(args.trial)
    t, view = resolved.trial, resolved.view
    metric = view.metric or "metric"
    best = "" if t.metric is None else f"{t.metric:.6g} at batch {t.best_step}"
    latest = "" if t.latest is None else f"{t.latest:.6g} at batch {t.progress.latest_step}"
    print(f"trial {resolved.label}: {t.state}, {t.batches} batches")
    print(f"  MLflow run {t.run_id} in experiment {view.name!r}")
    print(f"  best {metric}: {best or 'none yet'}")
    print(f"  latest {metric}: {latest or 'none yet'}")
    print(f"  best checkpoint: {t.checkpoint or 'none yet'}")
    for name, value in sorted(trial_hparams(tracking_reader_from_env(), t.run_id).items()):
        print(f"  hparam {name} = {value}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from det_cli.submission import print_logs

    resolved = resolve_trial(args.trial)
    return print_logs(
        resolved.flow_run.id,
        follow=args.follow,
        task_name_contains=f"trial-{resolved.trial.trial_id} ",
    )


def cmd_kill(args: argparse.Namespace) -> int:
    """Kill one trial. flows/lifecycle.py stops whole experiments only, so a trial is killed
    when it is its experiment's only trial; otherwise this refuses, naming the alternative."""
    from flows import lifecycle

    resolved = resolve_trial(args.trial)
    shown = short_id(resolved.flow_run.id)
    if len(resolved.view.trials) != 1:
        raise DetTasksError(
            f"killing one of experiment {shown}'s {len(resolved.view.trials)} trials is not "
            f"supported here: `det experiment kill {shown}` stops all of them"
        )
    message = lifecycle.kill(str(resolved.flow_run.id))
    print(f"trial {resolved.label} is experiment {shown}'s only trial: {message}")
    return 0
