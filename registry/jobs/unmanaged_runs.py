"""An unmanaged run (Determined's ``core_v2`` unmanaged mode): a plain script, started by
hand anywhere, reports to the platform as an experiment of one trial without a flow.

It gets the records a flow's experiment gets, so every existing view shows it:
- an MLflow experiment, a parent run and a trial run (``registry.runs.tracking.ExperimentRuns``,
  through ``registry.jobs.trial_services.trial_services``: the same tags, the S3 store, the
  metrics sink, and the rule that a run is COMPLETED only when it is);
- a heartbeat on the parent run while the script lives, so a script killed without a word
  is ended ORPHANED by the next ``det experiment list`` rather than left RUNNING;
- where ``PREFECT_API_URL`` is set, a flow run of the experiment flow (no deployment: no
  worker ever picks it up) whose id is the experiment's key, so ``det experiment list``
  lists it with the flow-run experiments, and whose state follows the script's end.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
import uuid as uuid_lib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from det_tasks.cluster_info import ClusterInfo, TrialInfo
from det_tasks.errors import ConfigError
from det_tasks.run_services import RunServices
from registry.checkpoints.store import checkpoint_records
from registry.jobs.trial_services import finish_experiment, trial_services
from registry.runs.run_states import HEARTBEAT_S, heartbeat
from registry.runs.tracking import ExperimentRuns, client_for
from registry.servers import s3 as s3_lib
from registry.servers.json_http import Retries, request_json
from registry.servers.settings import RegistrySettings

__all__ = ["EXPERIMENT_FLOW", "UNMANAGED_TAG", "unmanaged_services"]

EXPERIMENT_FLOW = "experiment"  # flows.prefect_rest.EXPERIMENT_FLOW: what `det` lists
UNMANAGED_TAG = "det-unmanaged"  # the flow run's Prefect tag
_EXTERNAL_TAG = "det-external:"  # + external_experiment_id: the run a later script rejoins
_RETRIES = Retries(4, frozenset({408, 429, 502, 503}), first_s=1.0)


@contextlib.contextmanager
def unmanaged_services(
    raw_config: dict[str, Any],
    hparams: dict[str, Any],
    *,
    script: Path | None,
    external_experiment_id: str | None = None,
    external_trial_id: str | None = None,
) -> Iterator[RunServices]:
    """The trial's services (with its cluster info) for the block; the runs, the heartbeat
    and the flow run end with it: COMPLETED, or ERROR on an exception."""
    settings = RegistrySettings.from_env()
    if not settings.tracking_uri:
        raise ConfigError(
            "core_v2.init(): unmanaged mode reports to the platform: set MLFLOW_TRACKING_URI "
            "and the S3 settings (source .stack/env after make up), or run the script with "
            "`det-tasks run CONFIG`"
        )
    name = str(raw_config["name"])
    flow_run = _open_flow_run(name, raw_config, external_experiment_id)
    key = flow_run or external_experiment_id or uuid_lib.uuid4().hex
    client = client_for(settings.tracking_uri)
    runs = ExperimentRuns(client, name, key, raw_config)
    runs.reopen(runs.parent_run_id)  # a rejoined experiment (external id) runs again
    beating = _Heartbeat(client, runs.parent_run_id)
    ended = ("FAILED", "ERROR")
    try:
        with (
            _code_folder(script) as code,
            trial_services(
                raw_config,
                hparams,
                model_dir=code,
                experiment_name=name,
                trial_id=external_trial_id or "1",
                experiment_run_key=key,
            ) as services,
        ):
            info = _cluster_info(client, services, raw_config, hparams, key, external_trial_id)
            yield dataclasses.replace(services, cluster_info=info)
        ended = ("FINISHED", "COMPLETED")
    finally:
        beating.stop()
        status, state = ended
        finish_experiment(runs, s3_lib.LazyClient(settings.s3_endpoint), status, state)
        if flow_run is not None:
            _set_flow_run_state(flow_run, "COMPLETED" if status == "FINISHED" else "FAILED")


def _cluster_info(
    client: Any,
    services: RunServices,
    raw_config: dict[str, Any],
    hparams: dict[str, Any],
    key: str,
    external_trial_id: str | None,
) -> ClusterInfo:
    """What ``det.get_cluster_info()`` answers in the script: its trial, and the newest
    checkpoint of a rejoined trial (``external_trial_id``) as ``latest_checkpoint``."""
    run_id = str(services.metrics_sink.run_id)
    records = checkpoint_records(client, run_id) if external_trial_id else []
    trial_id: int | str = external_trial_id or 1
    return ClusterInfo(
        trial=TrialInfo(
            trial_id=trial_id,
            experiment_id=key,
            hparams=dict(hparams),
            config=raw_config,
            trial_seed=0,
        ),
        latest_checkpoint=records[-1]["uri"] if records else None,
        checkpoint_dir=tempfile.mkdtemp(prefix="det-tasks-unmanaged-"),
    )


@contextlib.contextmanager
def _code_folder(script: Path | None) -> Iterator[Path]:
    """A folder holding only the script, whose hash is the run's ``det.code_version`` (the
    folder a script sits in may be a home directory)."""
    folder = Path(tempfile.mkdtemp(prefix="det-tasks-unmanaged-code-"))
    try:
        if script is not None and script.is_file():
            shutil.copy2(script, folder / script.name)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Heartbeat:
    """Beats on the parent run every ``HEARTBEAT_S`` from a daemon thread, as a flow does."""

    def __init__(self, client: Any, parent_run_id: str) -> None:
        self._client = client
        self._parent = parent_run_id
        self._stop = threading.Event()
        heartbeat(client, parent_run_id)
        self._thread = threading.Thread(target=self._run, name="det-unmanaged-heartbeat")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is not the script's failure
                heartbeat(self._client, self._parent)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _open_flow_run(
    name: str, raw_config: dict[str, Any], external_experiment_id: str | None
) -> str | None:
    """The id of the experiment's flow run, RUNNING: the external id's earlier one, or a
    new one; None without ``PREFECT_API_URL`` (the run is then in MLflow only)."""
    if not os.environ.get("PREFECT_API_URL"):
        return None
    flow = _prefect("POST", "/flows/", {"name": EXPERIMENT_FLOW})
    tags = [UNMANAGED_TAG]
    if external_experiment_id:
        tags.append(_EXTERNAL_TAG + external_experiment_id)
        found = _prefect(
            "POST",
            "/flow_runs/filter",
            {"flow_runs": {"tags": {"all_": tags}}, "sort": "START_TIME_DESC", "limit": 1},
        )
        if found:
            _set_flow_run_state(str(found[0]["id"]), "RUNNING")
            return str(found[0]["id"])
    body = {
        "flow_id": flow["id"],
        "name": f"unmanaged-{name}",
        "parameters": {"config_yaml": _yaml(raw_config), "unmanaged": True},
        "tags": tags,
        "state": {"type": "RUNNING", "name": "Running"},
    }
    return str(_prefect("POST", "/flow_runs/", body)["id"])


def _set_flow_run_state(flow_run_id: str, state_type: str) -> None:
    state = {"type": state_type, "name": state_type.capitalize()}
    _prefect("POST", f"/flow_runs/{flow_run_id}/set_state", {"state": state, "force": True})


def _prefect(method: str, path: str, body: Any) -> Any:
    """One call to Prefect's REST API with its environment's credentials."""
    headers = {}
    if os.environ.get("PREFECT_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['PREFECT_API_KEY']}"
    elif os.environ.get("PREFECT_API_AUTH_STRING"):
        token = base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    url = os.environ["PREFECT_API_URL"].rstrip("/") + path
    return request_json(method, url, body, headers=headers, retries=_RETRIES)


def _yaml(raw_config: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(raw_config, sort_keys=False))
