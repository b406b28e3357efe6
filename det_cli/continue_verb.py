"""``det experiment continue ID [--config KEY=VALUE ...] [--config-file FILE]``: Determined's
verb. A single-trial experiment that ended (COMPLETED, CANCELED, ERROR, or its flow died)
goes on from its trial's newest checkpoint, in the same experiment (the same flow run, run
again as Prefect's Retry does) and the same MLflow runs, with the config changes given
(``searcher.max_length`` to train longer). The rules and the records are
registry.experiments.continuation's; this module finds the flow run, merges the changes into the
parameters it runs with, and schedules it again."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from det_tasks.errors import DetTasksError

__all__ = [
    "add_config_overrides",
    "cmd_continue",
    "continue_hint",
    "file_overrides",
    "register_continue",
]


def register_continue(verbs: Any) -> None:
    p = verbs.add_parser(
        "continue",
        help="continue a single-trial experiment that ended, from its newest checkpoint",
    )
    p.add_argument("id", metavar="EXPERIMENT_ID", help="8-hex short id or full UUID")
    add_config_overrides(p, "config change, e.g. searcher.max_length.batches=200 (repeatable)")
    p.add_argument(
        "--config-file",
        type=Path,
        help="a YAML mapping of the config fields to change, merged into its config",
    )
    p.add_argument("-f", "--follow", action="store_true", help="stream its logs until it ends")
    p.set_defaults(func=cmd_continue)


def add_config_overrides(parser: argparse.ArgumentParser, text: str) -> None:
    """Determined's repeatable ``--config KEY=VALUE`` (into ``args.param``)."""
    parser.add_argument(
        "--config", dest="param", action="append", default=[], metavar="KEY=VALUE", help=text
    )


def file_overrides(path: Path) -> list[str]:
    """A partial config file as ``dotted.key=value`` overrides (values as JSON, which YAML
    reads back): mappings merge field by field, anything else replaces the field."""
    from det_tasks.config.loader import read_config_file

    raw = read_config_file(path)
    if not isinstance(raw, dict) or not raw:
        raise DetTasksError(
            f"--config-file {path}: a config file is a non-empty YAML mapping of the fields "
            "to change (e.g. searcher: {max_length: {batches: 200}})"
        )
    out: list[str] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)
        else:
            out.append(f"{prefix}={json.dumps(value, default=str)}")

    walk("", raw)
    return out


def cmd_continue(args: argparse.Namespace) -> int:
    from det_cli.ids import experiment_run, short_id
    from flows import lifecycle, prefect_rest
    from registry.cli import tracking_client_from_env, tracking_reader_from_env
    from registry.experiments.continuation import (
        NothingToContinue,
        apply_continuation,
        plan_continuation,
    )

    run = experiment_run(args.id)
    short = short_id(run.id)
    if lifecycle.settle_dead_holders(tracking_reader_from_env(), [run]):
        run = prefect_rest.read_flow_run(run.id)  # its flow was gone: now Crashed
    if run.state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED", "PAUSED"):
        raise DetTasksError(
            f"experiment {short} is {prefect_rest.experiment_state(run.state)}: only an "
            f"experiment that ended can be continued; wait for it (`det experiment wait "
            f"{short}`) or stop it (`det experiment pause {short}`)"
        )
    parameters = dict(run.parameters)
    extra = (file_overrides(args.config_file) if args.config_file else []) + list(args.param)
    overrides = [*(parameters.get("overrides") or []), *extra]
    raw, cfg = _merged_config(short, parameters, overrides)
    client = tracking_client_from_env()
    try:
        plan = plan_continuation(client, str(run.id), cfg)
    except NothingToContinue as done:
        print(str(done)[0].upper() + str(done)[1:])
        return 0
    apply_continuation(client, plan, raw)
    prefect_rest.update_flow_run_parameters(run.id, {**parameters, "overrides": overrides})
    if run.state == "PAUSED":
        prefect_rest.resume_flow_run(run.id)
    else:
        lifecycle.reschedule(run.id, f"det experiment continue {short}")
    print(f"Continued experiment {short}: {plan.summary()}")
    if args.follow:
        from det_cli.submission import print_logs

        return print_logs(run.id)
    return 0


def _merged_config(short: str, parameters: dict[str, Any], overrides: list[str]) -> Any:
    """The experiment's config as its flow run ships it, with ``overrides``, validated."""
    from det_cli.config_file import load_config

    text = parameters.get("config_yaml")
    if not isinstance(text, str):
        raise DetTasksError(
            f"experiment {short} was not created by `det experiment create` (its flow run "
            "carries no config): continue it where it ran, with python -m flows.experiment "
            "CONFIG --continue KEY"
        )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / Path(str(parameters.get("config") or "config.yaml")).name
        path.write_text(text, encoding="utf-8")
        return load_config(path, overrides)


def continue_hint(reader: Any, run: Any) -> str | None:
    """The line ``det experiment describe`` ends with for an experiment that can go on: how
    (activate for a paused one or one whose flow died, continue for a single-trial one that
    ended), and where a dead one stopped. None for an active one or one without runs."""
    from det_cli.ids import short_id
    from registry.experiments.view import find_parent, trial_runs_of
    from registry.runs.run_records import STATE_TAG

    short = short_id(run.id)
    if run.state == "PAUSED":
        return f"paused; continue it with: det experiment activate {short}"
    if run.state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        return None
    found = find_parent(reader, str(run.id))
    if found is None:
        return None
    trials = trial_runs_of(reader, found[0])
    if found[0].data.tags.get(STATE_TAG) == "ORPHANED":
        batch = max((int(t.data.metrics.get("progress/batches", 0)) for t in trials), default=0)
        return (
            f"stopped at batch {batch} without finishing; continue it with: "
            f"det experiment activate {short}"
        )
    if len(trials) > 1:
        return None
    longer = " --config searcher.max_length.batches=N" if run.state == "COMPLETED" else ""
    return f"continue it with: det experiment continue {short}{longer}"
