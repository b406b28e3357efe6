"""``det-tasks`` subcommands for the registry: experiments, checkpoints, models, gc, download."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from det_tasks.errors import DetTasksError

# The command functions import MLflow/boto3 lazily: `det-tasks run` should not pay for them.

__all__ = [
    "create_model",
    "delete_experiment_runs",
    "end_orphans_seen",
    "experiment_key_of_trial_run",
    "experiment_labels",
    "experiment_parent",
    "print_checkpoints",
    "print_models",
    "print_table",
    "ranked_checkpoints",
    "register",
    "register_checkpoint_version",
    "set_experiment_description",
    "set_experiment_label",
    "set_experiment_name",
    "tracking_client_from_env",
    "tracking_reader_from_env",
    "trial_hparams",
]


def _tracking_uri() -> str:
    from registry.servers.settings import RegistrySettings

    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise DetTasksError("MLFLOW_TRACKING_URI is not set (after `make up`: source .stack/env)")
    return settings.tracking_uri


def tracking_client_from_env() -> Any:
    from registry.runs.tracking import client_for

    return client_for(_tracking_uri())


def tracking_reader_from_env() -> Any:
    """For commands that only read: MLflow's REST API over the standard library when the
    server allows (registry.runs.mlflow_rest: no MLflow import), else MLflow's client."""
    from registry.runs.mlflow_rest import reader_for

    return reader_for(_tracking_uri())


def end_orphans_seen(reader: Any) -> list[str]:
    """End the experiment runs whose flow is gone (registry.runs.run_states.end_orphans), found
    through ``reader``: MLflow's client is loaded only when there is one to end."""
    from registry.runs.run_records import HEARTBEAT_TAG, orphaned

    experiments = [e.experiment_id for e in reader.search_experiments()]
    if not experiments:
        return []
    running = reader.search_runs(
        experiments,
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HEARTBEAT_TAG}` != ''",
        max_results=1000,
    )
    gone = sorted({run.info.experiment_id for run in running if orphaned(run)})
    if not gone:
        return []
    from registry.runs.run_states import end_orphans

    return end_orphans(tracking_client_from_env(), gone)


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def cmd_experiments(args: argparse.Namespace) -> int:
    client = tracking_client_from_env()
    rows = []
    for exp in client.search_experiments():
        if exp.name == "Default":
            continue
        runs = client.search_runs([exp.experiment_id], max_results=1000)
        trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        rows.append([exp.experiment_id, exp.name, len(trials)])
    print_table(rows, ["id", "name", "trials"])
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """Every checkpoint of the latest experiment run, best searcher metric first (those
    without a validation of it last, newest first)."""
    from registry.checkpoints import models as models_lib

    if args.experiment == "import":
        return cmd_import(args)
    if args.sources:
        raise DetTasksError(
            f"`checkpoints {args.experiment}` lists one experiment; to adopt Determined "
            "checkpoints use `checkpoints import DIR|s3://... --experiment NAME`"
        )
    client = tracking_client_from_env()
    print_checkpoints(client, models_lib.parent_run(client, args.experiment))
    return 0


def ranked_checkpoints(
    client: Any, parent: Any
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """An experiment run's checkpoint records, each with its ``trial`` (run name),
    ``trial_id`` and ``run_id``: (searcher metric, those validated with it best first, the
    rest newest first). Reads through MLflow's client or registry.runs.mlflow_rest's reader."""
    from registry.experiments.view import searcher_of, trial_runs_of
    from registry.runs.run_records import TRIAL_TAG, checkpoint_records_of, rank_by_metric

    metric, smaller = searcher_of(parent)
    records = [
        {
            **record,
            "trial": run.info.run_name,
            "trial_id": run.data.tags.get(TRIAL_TAG, ""),
            "run_id": run.info.run_id,
        }
        for run in trial_runs_of(client, parent)
        for record in checkpoint_records_of(run)
    ]
    ranked = rank_by_metric(records, metric, smaller) if metric else []
    scored = {id(r) for r in ranked}
    rest = sorted(
        (r for r in records if id(r) not in scored),
        key=lambda r: -int(r.get("steps_completed", 0)),
    )
    return metric, ranked, rest


def print_checkpoints(
    client: Any, parent: Any, best: int | None = None, batch_order: bool = False
) -> int:
    """Table of the experiment run's checkpoints, best first (``batch_order``: by trial,
    then batch, as ``det experiment list-checkpoints`` lists them); with ``best``, only the
    best N validated ones (Determined's ``list-checkpoints --best N``). Returns the rows
    printed."""
    from registry.experiments.view import trial_order

    metric, ranked, rest = ranked_checkpoints(client, parent)
    shown = ranked[:best] if best is not None else [*ranked, *rest]
    if batch_order:
        shown.sort(key=lambda r: (trial_order(str(r["trial_id"])), int(r["steps_completed"])))
    rows = [
        [
            r["trial"],
            r["steps_completed"],
            (r.get("validation_metrics") or {}).get(metric),
            r.get("uuid"),
            r["uri"],
        ]
        for r in shown
    ]
    print_table(rows, ["trial", "batches", metric or "metric", "uuid", "uri"])
    return len(rows)


def cmd_import(args: argparse.Namespace) -> int:
    from registry.checkpoints.importer import import_checkpoints
    from registry.servers import s3 as s3_lib
    from registry.servers.settings import RegistrySettings

    client = tracking_client_from_env()
    imported = import_checkpoints(
        client,
        s3_lib.client(),
        list(args.sources),
        args.into,
        artifacts_destination=RegistrySettings.from_env().artifacts_destination,
    )
    print_table(
        [[i.source, i.trial_id, i.steps_completed, i.trial_cls_spec, i.uri] for i in imported],
        ["source", "trial", "batches", "trial class", "uri"],
    )
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from registry.checkpoints.uris import fetch_checkpoint_uri

    dest = _new_destination(args.dest)
    cached = fetch_checkpoint_uri(args.uri)  # a refused or missing source: nothing is made
    _copy_into_place(cached, dest, args.dest)
    print(dest)
    return 0


def _new_destination(text: str) -> Path:
    """DEST with ``.``, ``..`` and links resolved before anything is made, so ``a/../b``
    makes only ``b`` (no stray ``a``)."""
    dest = Path(text).expanduser().resolve()
    if dest.exists():
        raise DetTasksError(f"download destination {text!r} already exists; name a new directory")
    return dest


def _copy_into_place(source: Path, dest: Path, shown: str) -> None:
    """Copy beside ``dest`` and rename into place: a failed copy leaves no directory, neither
    ``dest`` nor the parents made for it."""
    made = next((p for p in reversed([dest.parent, *dest.parent.parents]) if not p.exists()), None)
    tmp: Path | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        os.rename(tmp, dest)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise DetTasksError(
            f"cannot write the download to {shown!r}: {err.strerror or err}; "
            "name a writable destination"
        ) from None


def cmd_register(args: argparse.Namespace) -> int:
    from registry.checkpoints import models as models_lib

    client = tracking_client_from_env()
    best = models_lib.best_checkpoint(client, args.experiment)
    version = models_lib.register_checkpoint(client, args.name, best, args.alias)
    alias = f" (alias {args.alias})" if args.alias else ""
    print(
        f"registered {best.uri} as models:/{args.name}/{version}{alias}: "
        f"{best.metric}={best.value:.6g} at batch {best.steps_completed}"
    )
    return 0


def cmd_alias(args: argparse.Namespace) -> int:
    from registry.checkpoints import models as models_lib

    models_lib.set_alias(tracking_client_from_env(), args.name, args.alias, args.version)
    print(f"models:/{args.name}@{args.alias} -> version {args.version}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    print_models(tracking_reader_from_env())
    return 0


def print_models(client: Any, name: str | None = None) -> None:
    """Registered models (or the one named), their versions, aliases and sources, read
    through ``client``: MLflow's, or its REST reader (tracking_reader_from_env)."""
    if name is not None:
        try:
            models = [client.get_registered_model(name)]
        except Exception as err:
            from registry.servers.mlflow_errors import refused_by_mlflow

            if not refused_by_mlflow(err):
                raise
            raise DetTasksError(
                f"no registered model named {name!r} (`det model list` lists them)"
            ) from None
    else:
        models = list(client.search_registered_models())
    rows = []
    for model in models:
        aliases = {v: k for k, v in (model.aliases or {}).items()}
        for version in client.search_model_versions(f"name = '{model.name}'"):
            rows.append(
                [model.name, version.version, aliases.get(version.version, ""), version.source]
            )
    print_table(rows, ["name", "version", "alias", "source"])


def create_model(client: Any, name: str, description: str | None) -> None:
    """A new, empty registered model; one that exists already is an error."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)
        return
    raise DetTasksError(f"a model named {name!r} exists already (`det model describe {name}`)")


def register_checkpoint_version(client: Any, name: str, checkpoint_uuid: str) -> str:
    """Register the checkpoint with this uuid as a new version of ``name``; its version."""
    from registry.checkpoints import models as models_lib
    from registry.checkpoints.store import (
        checkpoint_records,
        resolve_checkpoint_uuid,
        validation_value,
    )

    uri = resolve_checkpoint_uuid(checkpoint_uuid)
    run_id = uri.split("/")[1]
    record = next(r for r in checkpoint_records(client, run_id) if r["uuid"] == checkpoint_uuid)
    parent_id = client.get_run(run_id).data.tags.get("mlflow.parentRunId")
    metric = client.get_run(parent_id).data.tags.get("det.searcher.metric", "") if parent_id else ""
    value = validation_value(record, metric) if metric else None
    best = models_lib.BestCheckpoint(
        run_id,
        checkpoint_uuid,
        uri,
        metric,
        float("nan") if value is None else value,
        int(record.get("steps_completed", 0)),
    )
    return models_lib.register_checkpoint(client, name, best)


def experiment_key_of_trial_run(client: Any, run_id: str) -> str:
    """The experiment key (flow-run id) of the experiment run a trial's MLflow run is in."""
    from registry.runs.run_records import EXPERIMENT_RUN_TAG, PARENT_TAG

    try:
        run = client.get_run(run_id)
    except Exception as err:  # the server's refusal (MlflowException, MlflowReaderError)
        if not getattr(err, "error_code", None):  # not reached, or not MLflow's answer
            raise
        raise DetTasksError(f"MLflow has no run {run_id!r}") from None
    parent_id = run.data.tags.get(PARENT_TAG)
    key = client.get_run(parent_id).data.tags.get(EXPERIMENT_RUN_TAG) if parent_id else None
    if not key:
        raise DetTasksError(f"MLflow run {run_id!r} is not a trial of an experiment run")
    return str(key)


def trial_hparams(client: Any, run_id: str) -> dict[str, str]:
    """The trial's hyperparameters, as its MLflow run records them (``hp.*`` params)."""
    params = client.get_run(run_id).data.params
    return {k[len("hp.") :]: v for k, v in params.items() if k.startswith("hp.")}


def cmd_gc(args: argparse.Namespace) -> int:
    from registry.checkpoints import models as models_lib
    from registry.checkpoints.gc import collect_experiment_garbage
    from registry.servers import s3 as s3_lib

    client = tracking_client_from_env()
    parent = models_lib.parent_run(client, args.experiment)
    result = collect_experiment_garbage(
        client, s3_lib.client(), parent, models_lib.trial_runs(client, parent)
    )
    print(
        f"kept {len(result.kept)}, deleted {len(result.deleted)}, "
        f"protected by registered models {len(result.protected)}"
    )
    return 0


# An experiment as ``det`` names it is one experiment run: its MLflow parent run (tagged
# with the flow-run id) and the trial runs under it. These edit that run, not the MLflow
# experiment, which the runs of every config of the same name share.

LABEL_TAG = "det.label."


def experiment_parent(client: Any, run_key: str) -> Any:
    """The MLflow parent run of the experiment run ``run_key`` (its flow-run id)."""
    from registry.experiments.view import find_parent

    found = find_parent(client, run_key)
    if found is None:
        raise DetTasksError(f"experiment {run_key} has no MLflow run yet; try again once it starts")
    return found[0]


def set_experiment_description(client: Any, run_key: str, description: str) -> None:
    """The description the MLflow UI shows on the run's page (its note)."""
    from registry.runs.tracking import DESCRIPTION_TAG

    client.set_tag(experiment_parent(client, run_key).info.run_id, DESCRIPTION_TAG, description)


def set_experiment_name(client: Any, run_key: str, name: str) -> None:
    """The parent run's name (the MLflow experiment keeps its config name)."""
    if not name.strip():
        raise DetTasksError("the new name is empty: give a name")
    client.update_run(experiment_parent(client, run_key).info.run_id, name=name)


def experiment_labels(parent: Any) -> list[str]:
    return sorted(k[len(LABEL_TAG) :] for k in parent.data.tags if k.startswith(LABEL_TAG))


def set_experiment_label(client: Any, run_key: str, label: str, present: bool) -> list[str]:
    """Add (``present``) or remove one label; returns the labels after."""
    import re

    if not re.fullmatch(r"[\w.\- /]{1,200}", label):
        raise DetTasksError(
            f"label {label!r} has characters MLflow tags refuse: use letters, digits, "
            "_ - . / and spaces"
        )
    parent = experiment_parent(client, run_key)
    if present:
        client.set_tag(parent.info.run_id, LABEL_TAG + label, "")
    elif LABEL_TAG + label in parent.data.tags:
        client.delete_tag(parent.info.run_id, LABEL_TAG + label)
    else:
        raise DetTasksError(
            f"experiment {run_key} has no label {label!r} (labels: "
            f"{', '.join(experiment_labels(parent)) or 'none'})"
        )
    return experiment_labels(client.get_run(parent.info.run_id))


def delete_experiment_runs(client: Any, run_key: str) -> int:
    """Delete the parent run and its trial runs (MLflow's soft delete: restorable until an
    ``mlflow gc``); returns how many runs. Checkpoint bytes stay on S3, where registered
    model versions may still use them."""
    from registry.checkpoints import models as models_lib

    parent = experiment_parent(client, run_key)
    runs = [*models_lib.trial_runs(client, parent), parent]
    for run in runs:
        client.delete_run(run.info.run_id)
    return len(runs)


def register(sub: Any) -> None:
    """Add the registry's subcommands to ``det-tasks``."""
    p = sub.add_parser("experiments", help="list MLflow experiments and their trial counts")
    p.set_defaults(func=cmd_experiments)
    p = sub.add_parser(
        "checkpoints",
        help="list an experiment's checkpoints with their metric (`checkpoints EXPERIMENT`), "
        "or adopt reviewed Determined checkpoints (`checkpoints import DIR|s3://... "
        "--experiment NAME`)",
    )
    p.add_argument("experiment", help="an experiment to list, or `import`")
    p.add_argument("sources", nargs="*", help="with import: checkpoint directories or s3://")
    p.add_argument(
        "--experiment",
        dest="into",
        default="determined-import",
        help="with import: the MLflow experiment to register them under",
    )
    p.set_defaults(func=cmd_checkpoints)
    p = sub.add_parser("download", help="download a checkpoint (s3://, runs:/, models:/) to DEST")
    p.add_argument("uri")
    p.add_argument("dest")
    p.set_defaults(func=cmd_download)
    models = sub.add_parser("models", help="the model registry").add_subparsers(
        dest="models_command", required=True
    )
    p = models.add_parser("register", help="register an experiment's best checkpoint")
    p.add_argument("experiment")
    p.add_argument("name")
    p.add_argument("--alias", help="also point this alias (e.g. champion) at the new version")
    p.set_defaults(func=cmd_register)
    p = models.add_parser("alias", help="point an alias at a version")
    p.add_argument("name")
    p.add_argument("version")
    p.add_argument("alias")
    p.set_defaults(func=cmd_alias)
    p = models.add_parser("list", help="registered models, versions and aliases")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("gc", help="apply the checkpoint retention policy to an experiment now")
    p.add_argument("experiment")
    p.set_defaults(func=cmd_gc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
