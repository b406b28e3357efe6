"""``det-tasks experiment create|list|describe`` and ``det-tasks job run``: the seed documents'
``det experiment create const.yaml .`` and ``det job run batch_inference.yaml .``.

The config is validated here, before anything is uploaded; the model directory is packed
(``.detignore`` honoured, size-limited) and uploaded to S3 under its content hash; then a
run of the ``experiment/submitted`` (or ``batch-inference/submitted``) deployment gets the
package's URI, which is all a worker on any machine needs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from det_cli.numbers import positive_number
from det_tasks.errors import ConfigError, DetTasksError
from flows.deployment_runs import log_reader, start_deployment_run
from flows.job_settings import USER_TAG_PREFIX, check_pool, local_user

__all__ = [
    "EXPERIMENT_DEPLOYMENT",
    "JOB_DEPLOYMENT",
    "cmd_experiment_create",
    "cmd_experiment_describe",
    "cmd_experiment_list",
    "cmd_job_run",
    "experiment_runs",
    "find_flow_run",
    "print_logs",
    "print_trials",
    "queue_at_create",
    "register",
    "submit_options",
]

EXPERIMENT_DEPLOYMENT = "experiment/submitted"
JOB_DEPLOYMENT = "batch-inference/submitted"
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}  # Prefect's state types


def register(sub: Any) -> None:
    experiment = sub.add_parser("experiment", help="submit and inspect experiments (Prefect)")
    exp_sub = experiment.add_subparsers(dest="experiment_command", required=True)
    create = exp_sub.add_parser("create", help="validate, ship MODEL_DIR and start the flow")
    create.add_argument("config", type=Path)
    create.add_argument("model_dir", type=Path)
    create.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. hyperparameters.learning_rate=0.5",
    )
    submit_options(create, EXPERIMENT_DEPLOYMENT)
    create.set_defaults(func=cmd_experiment_create)
    listing = exp_sub.add_parser("list", help="recent experiment runs, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=cmd_experiment_list)
    describe = exp_sub.add_parser("describe", help="one experiment run's trials")
    describe.add_argument("id", help="flow-run id (or a unique prefix of 8+ characters)")
    describe.set_defaults(func=cmd_experiment_describe)

    job = sub.add_parser("job", help="batch jobs (det job run)")
    job_sub = job.add_subparsers(dest="job_command", required=True)
    run = job_sub.add_parser("run", help="validate, ship MODEL_DIR and start batch inference")
    run.add_argument("config", type=Path)
    run.add_argument("model_dir", type=Path)
    submit_options(run, JOB_DEPLOYMENT)
    run.set_defaults(func=cmd_job_run)


def submit_options(parser: argparse.ArgumentParser, deployment: str) -> None:
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="stream the run's logs and exit with its final state",
    )
    parser.add_argument("--deployment", default=deployment, help=f"default: {deployment}")
    parser.add_argument(
        "--max-package-mb",
        type=positive_number("--max-package-mb"),
        default=95.0,
        help="refuse model directories larger than this (default 95, Determined's limit)",
    )


def _ship(model_dir: Path, max_mb: float, excluded_dirs: list[Path] | None = None) -> str:
    """Pack and upload the model directory, minus its checkpoint folders (``excluded_dirs``)."""
    from det_tasks.checkpoints.model_package import pack_model_dir
    from registry.experiments.packages import upload_package

    packed = pack_model_dir(
        model_dir, max_bytes=int(max_mb * 2**20), excluded_dirs=excluded_dirs or ()
    )
    uri, uploaded = upload_package(packed)
    verb = "Uploaded" if uploaded else "Reusing identical, already uploaded"
    print(
        f"Preparing files to send: {len(packed.files)} files, "
        f"{packed.total_bytes / 1024:.1f} KB. {verb} package {uri}"
    )
    return uri


def _ui_url(flow_run_id: Any) -> str:
    from flows.prefect_rest import ui_url

    return f"{ui_url()}/runs/flow-run/{flow_run_id}"


def cmd_experiment_create(args: argparse.Namespace, shown_id: Callable[[Any], str] = str) -> int:
    """``shown_id`` prints the flow-run id (``det`` shows its 8-character short form)."""
    from det_cli.config_file import load_config_text
    from det_tasks.config.experiment_name import named
    from det_tasks.config.storage_paths import check_storage_beside_code, code_exclusions
    from registry.runs.experiment_setup import ensure_experiment, mlflow_link
    from registry.runs.mlflow_rest import writer_for
    from registry.servers.settings import RegistrySettings

    # Read once and refused here, before any upload; the text is what the flow gets.
    config_text, raw, cfg = load_config_text(args.config, args.param)
    # Named once, here: the flow and its workers read the name from the overrides sent
    # (a config without `name:` is named after the file the user gave).
    raw, cfg, overrides = named(raw, cfg, args.config, list(args.param))
    check_storage_beside_code(cfg, args.model_dir)
    check_resource_pool(cfg.resources.resource_pool)
    package = _ship(args.model_dir, args.max_package_mb, code_exclusions(raw, args.model_dir))
    flow_run = start_deployment_run(
        args.deployment,
        {
            "config": args.config.name,
            "config_yaml": config_text,
            "overrides": overrides,
            "package": package,
        },
        tags=[USER_TAG_PREFIX + local_user()],
    )
    queue_at_create(str(flow_run.id), cfg)
    print(f"Created experiment {shown_id(flow_run.id)}")
    print(f"  Prefect flow run: {_ui_url(flow_run.id)}")
    settings = RegistrySettings.from_env()
    if settings.tracking_uri:
        exp_id = ensure_experiment(  # over MLflow's REST API where it serves
            writer_for(settings.tracking_uri), str(cfg.name), cfg.description
        )
        print(f"  MLflow experiment: {mlflow_link(settings.tracking_uri, exp_id)}")
    return print_logs(flow_run.id) if args.follow else 0


def check_resource_pool(pool: str | None) -> None:
    """Refuse a resources.resource_pool the stack's cluster lacks, in one line naming its
    pools (skipped without a scheduler to ask: the flow checks again)."""
    import os

    from cluster.environment import SCHEDULER_ENV
    from cluster.job_requests import cluster_pools_at
    from cluster.pools import DEFAULT_POOL

    address = os.environ.get(SCHEDULER_ENV)
    if not address:
        return
    try:
        pools = cluster_pools_at(address)
    except Exception:  # unreachable, or no queue there: the flow checks again and says so
        return
    check_pool(pools, pool or DEFAULT_POOL)


def queue_at_create(key: str, cfg: Any) -> None:
    """Queue the new experiment on the stack's job queue now, under its flow run's id (the
    key its flow reports under), so slots that free while its flow starts are shared with
    it (Determined's master knows a job from its creation). Skipped without a scheduler;
    a queue that cannot be reached only delays this to the flow's first report."""
    import os

    from cluster.environment import SCHEDULER_ENV
    from cluster.job_requests import queue_job
    from det_tasks.searchers.choose import trials_at_once
    from flows.job_settings import job_fields

    address = os.environ.get(SCHEDULER_ENV)
    if not address:
        return
    resources = cfg.resources
    try:
        at_once = trials_at_once(cfg)
    except Exception:  # a searcher only its flow can build: at most its concurrency
        at_once = max(1, cfg.searcher.max_concurrent_trials or 1)
    job = {
        **job_fields(cfg, str(cfg.name), at_once, local_user()),
        "priority": resources.priority,
        "weight": resources.weight,
        "max_slots": resources.max_slots,
        "slots_per_trial": resources.slots_per_trial,
    }
    try:
        queue_job(address, key, {k: v for k, v in job.items() if v is not None})
    except Exception as err:  # unreachable, or a scheduler without the queue's routes
        print(f"note: not queued yet ({err}); its flow queues it when it starts", file=sys.stderr)


def cmd_job_run(args: argparse.Namespace) -> int:
    from det_tasks.config.job import load_job_config

    raw, job = load_job_config(args.config)  # refused here, before any upload
    if job.script:
        package = _ship(args.model_dir, args.max_package_mb)
        parameters: dict[str, Any] = {"package": package, "script": job.script, "config": raw}
    else:
        parameters = dict(job.data)  # data: model_uri, dataset, ... are the flow's parameters
    flow_run = start_deployment_run(args.deployment, parameters)
    print(f"Created job {flow_run.id}")
    print(f"  Prefect flow run: {_ui_url(flow_run.id)}")
    return print_logs(flow_run.id) if args.follow else 0


def print_logs(flow_run_id: Any, follow: bool = True, task_name_contains: str | None = None) -> int:
    """Print the run's logs (with ``task_name_contains``, only those of its task runs whose
    name contains it: one trial's); with ``follow``, as they arrive until the run ends, then 0
    when it completed and 1 otherwise (without: the logs so far, then 0)."""
    state = None
    with log_reader(flow_run_id, task_name_contains) as reader:
        while True:
            state = reader.state()
            lines = reader.next_lines()
            for line in lines:
                print(line)
            if not follow and not lines:
                return 0
            if state in FINAL_STATES and not lines:
                break
            if follow:
                time.sleep(1.0)
    print(f"Flow run {flow_run_id} finished: {state}")
    return 0 if state == "COMPLETED" else 1


def experiment_runs(limit: int) -> list[Any]:
    """The newest ``limit`` flow runs of the experiment flow, newest first
    (flows.prefect_rest.FlowRun: what the commands read of them)."""
    from flows import prefect_rest

    return prefect_rest.experiment_runs(limit)


def experiment_state(run: Any) -> str:
    """The experiment's state in Determined's words (ACTIVE, PAUSED, CANCELED...)."""
    from flows.prefect_rest import experiment_state as state_of

    return state_of(run.state)


def cmd_experiment_list(args: argparse.Namespace, shown_id: Callable[[Any], str] = str) -> int:
    from registry.cli import end_orphans_seen, print_table, tracking_reader_from_env
    from registry.experiments.view import summarize_experiment_runs

    client = tracking_reader_from_env()
    # Runs whose flow died without a word (SIGKILL, a lost host) end here, ORPHANED, so a
    # listing never shows them RUNNING for more than a minute past their last heartbeat.
    for orphan in end_orphans_seen(client):
        print(f"ended MLflow run {orphan}: its flow stopped without a word", file=sys.stderr)
    runs = experiment_runs(args.limit)
    views = summarize_experiment_runs(client, [str(run.id) for run in runs])  # per page
    rows = []
    for run in runs:
        view = views.get(str(run.id))
        rows.append(
            [
                shown_id(run.id),
                view.name if view else _submitted_name(run.parameters),
                experiment_state(run),
                f"{run.start_time.astimezone():%Y-%m-%d %H:%M}" if run.start_time else "",
                view.trials if view else 0,
                f"{view.metric}={view.best:.6g}" if view and view.best is not None else "",
            ]
        )
    print_table(rows, ["id", "experiment", "state", "started", "trials", "best"])
    return 0


def _submitted_name(parameters: dict[str, Any]) -> str:
    """The experiment's name before its flow has made its MLflow runs: the config's
    ``name`` as submitted (not the file's name, as it was)."""
    from det_tasks.config.experiment_name import submitted_name

    return submitted_name(
        str(parameters.get("config", "")),
        parameters.get("config_yaml"),
        [str(o) for o in parameters.get("overrides") or []],
    )


def cmd_experiment_describe(args: argparse.Namespace, shown_id: Callable[[Any], str] = str) -> int:
    from registry.cli import tracking_reader_from_env
    from registry.experiments.view import describe_experiment_run

    run = find_flow_run(args.id)
    view = describe_experiment_run(tracking_reader_from_env(), str(run.id))
    print(f"experiment run {shown_id(run.id)}: {experiment_state(run)}")
    print(f"  Prefect flow run: {_ui_url(run.id)}")
    if view is None:
        print("  no MLflow runs yet")
        return 0
    print(
        f"  MLflow experiment {view.name!r} (id {view.experiment_id}), parent run "
        f"{view.parent_run_id}; searcher metric {view.metric!r} "
        f"({'smaller' if view.smaller_is_better else 'larger'} is better)"
    )
    print_trials(view)
    best = view.best
    if best is not None:
        print(
            f"best: trial {best.trial_id}, {view.metric}={best.metric:.6g} at batch "
            f"{best.best_step}, {best.checkpoint}"
        )
    return 0


def print_trials(view: Any, label: Callable[[str], str] = str) -> None:
    """One row per trial of an ``ExperimentView`` (``label``: how a trial id is shown):
    state, batches trained, best metric and its batch, latest metric, run, checkpoint, and
    the hosts it ran on."""
    from registry.cli import print_table

    metric = view.metric or "metric"
    rows = [
        [
            label(t.trial_id),
            t.state,
            t.batches,
            _number(t.metric),
            "" if t.best_step is None else t.best_step,
            _number(t.latest),
            t.run_id,
            t.checkpoint,
            ",".join(t.nodes),
        ]
        for t in view.trials
    ]
    header = ["trial", "state", "batches", f"best {metric}", "at batch", metric, "mlflow run"]
    print_table(rows, [*header, "best checkpoint", "nodes"])
    for t in view.trials:
        if t.reason and t.state in ("QUEUED", "PREEMPTED"):
            print(f"trial {label(t.trial_id)} {t.state}: {t.reason}")


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def find_flow_run(ident: str) -> Any:
    """The experiment flow run named by its id or a unique prefix of 8+ characters."""
    import uuid

    from flows.prefect_rest import PrefectError, read_flow_run

    try:
        full = uuid.UUID(ident)
    except ValueError:
        full = None
    if full is not None:
        try:
            return read_flow_run(full)
        except PrefectError as err:
            if err.status == 404:
                raise DetTasksError(f"no experiment run with id {ident!r}") from None
            raise _server_error(ident, err) from None
    if len(ident) < 8:
        raise ConfigError(f"experiment id {ident!r} is too short: give 8+ characters")
    try:
        runs = experiment_runs(200)
    except DetTasksError as err:
        raise _server_error(ident, err) from None
    matches = [r for r in runs if str(r.id).startswith(ident)]
    if len(matches) != 1:
        found = "no" if not matches else f"{len(matches)}"
        raise DetTasksError(f"{found} experiment runs match {ident!r}: give more characters")
    return matches[0]


_find_flow_run = find_flow_run  # the name the surfaced-errors test imports


def _server_error(ident: str, err: Exception) -> DetTasksError:
    """Looking a run up failed for a reason other than "not found": say which."""
    from flows.prefect_rest import api_url

    api = api_url() or "(no PREFECT_API_URL set)"
    return DetTasksError(
        f"could not look up experiment run {ident!r}: the Prefect server at {api} failed "
        f"({type(err).__name__}: {err}); is it up (make up) and are PREFECT_API_URL and "
        "PREFECT_API_KEY/PREFECT_API_AUTH_STRING right?"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m det_cli.submission")
    register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args()
    try:
        sys.exit(parsed.func(parsed))
    except DetTasksError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
