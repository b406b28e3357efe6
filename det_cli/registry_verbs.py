"""``det checkpoint`` and ``det model`` (``det m``): checkpoints by uuid, and MLflow's model
registry under Determined's verbs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from det_cli.unsupported import add_unsupported
from det_tasks.errors import DetTasksError

__all__ = ["register"]

UNSUPPORTED_MODEL = {
    "archive": "MLflow models have no archive; delete versions in the MLflow UI",
    "unarchive": "MLflow models have no archive",
    "delete": "delete a registered model in the MLflow UI",
    "move": "there are no workspaces; models live in the one MLflow registry",
    "rename": "rename a registered model in the MLflow UI",
    "list-versions": "`det model describe NAME` lists its versions",
}


def register(sub: Any) -> None:
    ckpt = sub.add_parser("checkpoint", help="checkpoints by uuid")
    verbs = ckpt.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = verbs.add_parser("describe", help="where it is, its trial, batch and metrics")
    p.add_argument("uuid")
    p.set_defaults(func=cmd_checkpoint_describe)
    p = verbs.add_parser("download", help="download it to OUTPUT_DIR (default checkpoints/UUID)")
    p.add_argument("uuid")
    p.add_argument("-o", "--output-dir", help="default: checkpoints/UUID")
    p.set_defaults(func=cmd_checkpoint_download)
    add_unsupported(verbs, "checkpoint", "delete", "checkpoints are deleted by the retention "
                    "policy; `det-tasks gc EXPERIMENT_NAME` applies it now")  # fmt: skip

    model = sub.add_parser("model", aliases=["m"], help="the model registry (MLflow)")
    verbs = model.add_subparsers(dest="verb", required=True, metavar="VERB")
    p = verbs.add_parser("create", help="a new registered model")
    p.add_argument("name")
    p.add_argument("--description", help="shown in the MLflow UI")
    p.set_defaults(func=cmd_model_create)
    p = verbs.add_parser("register-version", help="register a checkpoint as a new version")
    p.add_argument("name")
    p.add_argument("uuid", metavar="CHECKPOINT_UUID")
    p.set_defaults(func=cmd_model_register_version)
    p = verbs.add_parser("list", aliases=["ls"], help="registered models and their versions")
    p.set_defaults(func=cmd_model_list)
    p = verbs.add_parser("describe", help="one model's versions and aliases")
    p.add_argument("name")
    p.set_defaults(func=cmd_model_describe)
    for verb, instead in UNSUPPORTED_MODEL.items():
        add_unsupported(verbs, "model", verb, instead)


def _record(uuid: str) -> tuple[str, dict[str, Any]]:
    from registry.checkpoints.store import checkpoint_records, resolve_checkpoint_uuid
    from registry.cli import tracking_client_from_env

    uri = resolve_checkpoint_uuid(uuid)
    run_id = uri.split("/")[1]
    for record in checkpoint_records(tracking_client_from_env(), run_id):
        if record.get("uuid") == uuid:
            return uri, record
    raise DetTasksError(f"checkpoint {uuid!r}: MLflow run {run_id} no longer records it")


def cmd_checkpoint_describe(args: argparse.Namespace) -> int:
    uri, record = _record(args.uuid)
    print(f"checkpoint {args.uuid}")
    print(f"  uri: {uri}")
    print(f"  stored at: {record.get('uri')}")
    print(f"  trial run: {uri.split('/')[1]}, batch {record.get('steps_completed')}")
    for name, value in sorted((record.get("validation_metrics") or {}).items()):
        print(f"  validation {name} = {value}")
    return 0


def cmd_checkpoint_download(args: argparse.Namespace) -> int:
    from registry.checkpoints.store import resolve_checkpoint_uuid
    from registry.cli import cmd_download

    uri = resolve_checkpoint_uuid(args.uuid)
    dest = Path(args.output_dir) if args.output_dir else Path("checkpoints") / args.uuid
    return cmd_download(argparse.Namespace(uri=uri, dest=str(dest)))


def cmd_model_create(args: argparse.Namespace) -> int:
    from registry.cli import create_model, tracking_client_from_env

    create_model(tracking_client_from_env(), args.name, args.description)
    print(f"Created model {args.name!r}")
    return 0


def cmd_model_register_version(args: argparse.Namespace) -> int:
    from registry.cli import register_checkpoint_version, tracking_client_from_env

    version = register_checkpoint_version(tracking_client_from_env(), args.name, args.uuid)
    print(f"Registered checkpoint {args.uuid} as models:/{args.name}/{version}")
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    from registry.cli import print_models, tracking_reader_from_env

    print_models(tracking_reader_from_env())  # MLflow's REST API: no MLflow import
    return 0


def cmd_model_describe(args: argparse.Namespace) -> int:
    from registry.cli import print_models, tracking_reader_from_env

    print_models(tracking_reader_from_env(), args.name)
    return 0
