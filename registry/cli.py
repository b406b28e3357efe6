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

__all__ = ["register"]


def _client() -> Any:
    from registry.settings import RegistrySettings
    from registry.tracking import client_for

    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise DetTasksError("MLFLOW_TRACKING_URI is not set (after `make up`: source .stack/env)")
    return client_for(settings.tracking_uri)


def _table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def cmd_experiments(args: argparse.Namespace) -> int:
    client = _client()
    rows = []
    for exp in client.search_experiments():
        if exp.name == "Default":
            continue
        runs = client.search_runs([exp.experiment_id], max_results=1000)
        trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        rows.append([exp.experiment_id, exp.name, len(trials)])
    _table(rows, ["id", "name", "trials"])
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """Every checkpoint of the latest experiment run, best searcher metric first (those
    without a validation of it last, newest first)."""
    from registry import models as models_lib
    from registry.checkpoints import checkpoint_records, rank_by_metric

    if args.experiment == "import":
        return cmd_import(args)
    if args.sources:
        raise DetTasksError(
            f"`checkpoints {args.experiment}` lists one experiment; to adopt Determined "
            "checkpoints use `checkpoints import DIR|s3://... --experiment NAME`"
        )
    client = _client()
    parent = models_lib._parent_run(client, args.experiment)
    metric = parent.data.tags.get("det.searcher.metric", "")
    smaller = parent.data.tags.get("det.searcher.smaller_is_better", "True") == "True"
    records = [
        {**record, "trial": run.info.run_name}
        for run in models_lib.trial_runs(client, parent)
        for record in checkpoint_records(client, run.info.run_id)
    ]
    ranked = rank_by_metric(records, metric, smaller) if metric else []
    scored = {id(r) for r in ranked}
    rest = sorted(
        (r for r in records if id(r) not in scored),
        key=lambda r: -int(r.get("steps_completed", 0)),
    )
    rows = [
        [
            r["trial"],
            r["steps_completed"],
            (r.get("validation_metrics") or {}).get(metric),
            r["uri"],
        ]
        for r in [*ranked, *rest]
    ]
    _table(rows, ["trial", "batches", metric or "metric", "uri"])
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from registry import s3 as s3_lib
    from registry.importer import import_checkpoints
    from registry.settings import RegistrySettings

    client = _client()
    imported = import_checkpoints(
        client,
        s3_lib.client(),
        list(args.sources),
        args.into,
        artifacts_destination=RegistrySettings.from_env().artifacts_destination,
    )
    _table(
        [[i.source, i.trial_id, i.steps_completed, i.trial_cls_spec, i.uri] for i in imported],
        ["source", "trial", "batches", "trial class", "uri"],
    )
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from registry.uris import _fetch

    dest = _new_destination(args.dest)
    cached = _fetch(args.uri)  # a refused or missing source: nothing is made
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
    from registry import models as models_lib

    client = _client()
    best = models_lib.best_checkpoint(client, args.experiment)
    version = models_lib.register_checkpoint(client, args.name, best, args.alias)
    alias = f" (alias {args.alias})" if args.alias else ""
    print(
        f"registered {best.uri} as models:/{args.name}/{version}{alias}: "
        f"{best.metric}={best.value:.6g} at batch {best.steps_completed}"
    )
    return 0


def cmd_alias(args: argparse.Namespace) -> int:
    from registry import models as models_lib

    models_lib.set_alias(_client(), args.name, args.alias, args.version)
    print(f"models:/{args.name}@{args.alias} -> version {args.version}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    client = _client()
    rows = []
    for model in client.search_registered_models():
        aliases = {v: k for k, v in (model.aliases or {}).items()}
        for version in client.search_model_versions(f"name = '{model.name}'"):
            rows.append(
                [model.name, version.version, aliases.get(version.version, ""), version.source]
            )
    _table(rows, ["name", "version", "alias", "source"])
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from registry import models as models_lib
    from registry import s3 as s3_lib
    from registry.gc import collect_experiment_garbage

    client = _client()
    parent = models_lib._parent_run(client, args.experiment)
    result = collect_experiment_garbage(
        client, s3_lib.client(), parent, models_lib.trial_runs(client, parent)
    )
    print(
        f"kept {len(result.kept)}, deleted {len(result.deleted)}, "
        f"protected by registered models {len(result.protected)}"
    )
    return 0


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
