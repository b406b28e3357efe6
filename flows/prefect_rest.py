"""The few Prefect server calls ``det`` makes, over its REST API with the standard library.

Importing Prefect's client costs a command about 1.5-3.5 s before it sends anything (its
settings, pydantic schemas and httpx); ``det experiment describe|pause|kill`` need one or
two small requests, so they send them themselves. The address and credentials are
Prefect's own settings: ``PREFECT_API_URL``, ``PREFECT_API_KEY`` (a bearer token) or
``PREFECT_API_AUTH_STRING`` (basic auth), ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` and
``PREFECT_API_SSL_CERT_FILE``, from the environment, else the active Prefect profile; a
process that has imported Prefect anyway (a flow, a test) reads its current settings
instead, so both always agree.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import os
import ssl
import sys
import uuid
from pathlib import Path
from typing import Any

from det_tasks.errors import DetTasksError
from registry.servers.json_http import HttpRefused, Retries, Unreachable, request_json

__all__ = [
    "FlowRun",
    "PrefectError",
    "api_url",
    "create_deployment_run",
    "experiment_runs",
    "experiment_state",
    "read_flow_run",
    "read_logs",
    "resume_flow_run",
    "set_flow_run_state",
    "task_run_ids",
    "update_flow_run_parameters",
    "ui_url",
]

EXPERIMENT_FLOW = "experiment"
TIMEOUT_S = 30.0
# An experiment's state in Determined's words, from its flow run's Prefect state type.
EXPERIMENT_STATES = {
    "SCHEDULED": "ACTIVE",
    "PENDING": "ACTIVE",
    "RUNNING": "ACTIVE",
    "PAUSED": "PAUSED",
    "CANCELLING": "STOPPING_CANCELED",
    "CANCELLED": "CANCELED",
    "COMPLETED": "COMPLETED",
    "FAILED": "ERROR",
    "CRASHED": "ERROR",
}


class PrefectError(DetTasksError):
    """The Prefect server refused a request, or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class FlowRun:
    """What ``det`` reads of a flow run. ``state``: Prefect's state type (RUNNING, PAUSED,
    CANCELLED, ...; PENDING when it has none yet)."""

    id: uuid.UUID
    name: str
    state: str
    state_name: str
    state_message: str
    parameters: dict[str, Any]
    start_time: datetime.datetime | None
    state_since: datetime.datetime | None = None  # when it entered its current state

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FlowRun:
        state = data.get("state") or {}
        started = data.get("start_time")
        since = state.get("timestamp")
        return cls(
            id=uuid.UUID(str(data["id"])),
            name=str(data.get("name") or ""),
            state=str(data.get("state_type") or state.get("type") or "PENDING"),
            state_name=str(data.get("state_name") or state.get("name") or ""),
            state_message=str(state.get("message") or ""),
            parameters=dict(data.get("parameters") or {}),
            start_time=datetime.datetime.fromisoformat(started) if started else None,
            state_since=datetime.datetime.fromisoformat(since) if since else None,
        )


def prefect_loaded() -> bool:
    """Whether this process has Prefect's settings loaded (then they rule, as for its
    client: ``temporary_settings`` included)."""
    return "prefect.settings" in sys.modules


def _settings() -> tuple[str, str | None, str | None, bool, str | None]:
    """(API URL, API key, auth string, skip TLS verification, CA file)."""
    if prefect_loaded():
        from prefect.settings import get_current_settings

        api = get_current_settings().api
        key = api.key.get_secret_value() if api.key else None
        auth = api.auth_string.get_secret_value() if api.auth_string else None
        return (api.url or "", key, auth, api.tls_insecure_skip_verify, api.ssl_cert_file)
    env = {**_profile(), **os.environ}  # the environment wins, as in Prefect
    skip = env.get("PREFECT_API_TLS_INSECURE_SKIP_VERIFY", "").lower() in ("1", "true", "yes")
    return (
        env.get("PREFECT_API_URL", ""),
        env.get("PREFECT_API_KEY") or None,
        env.get("PREFECT_API_AUTH_STRING") or None,
        skip,
        env.get("PREFECT_API_SSL_CERT_FILE") or None,
    )


def _profile() -> dict[str, str]:
    """The active Prefect profile's settings (``PREFECT_PROFILES_PATH``, else
    ``$PREFECT_HOME/profiles.toml``; ``PREFECT_PROFILE`` picks one), as text."""
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        import tomllib

        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    name = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    chosen = (profiles.get("profiles") or {}).get(name) or {}
    return {str(k): str(v) for k, v in chosen.items()} if isinstance(chosen, dict) else {}


def api_url() -> str:
    return _settings()[0].rstrip("/")


def ui_url() -> str:
    """The Prefect UI's address: ``PREFECT_UI_URL``, else the API's without ``/api`` (what
    Prefect itself derives for a server of its own)."""
    if prefect_loaded():
        from prefect.settings import get_current_settings

        return (get_current_settings().ui_url or "").rstrip("/")
    explicit = os.environ.get("PREFECT_UI_URL")
    return (explicit or api_url().removesuffix("/api")).rstrip("/")


def experiment_state(prefect_state: str) -> str:
    """Determined's word for an experiment whose flow run is in ``prefect_state``."""
    return EXPERIMENT_STATES.get(prefect_state, prefect_state)


def _request(method: str, path: str, body: Any = None) -> Any:
    """One API call, retried as Prefect's client retries it: on 408, 429, 502, 503 (and
    ``PREFECT_CLIENT_RETRY_EXTRA_CODES``) and on timeouts, up to
    ``PREFECT_CLIENT_MAX_RETRIES`` (5) times, after ``Retry-After`` or 2, 4, 8... s."""
    url, key, auth, skip_verify, ca_file = _settings()
    if not url:
        raise PrefectError("PREFECT_API_URL is not set: start the stack (make up) or give -m")
    headers = {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    elif auth:
        headers["Authorization"] = f"Basic {base64.b64encode(auth.encode()).decode()}"
    context = None
    if url.startswith("https://"):
        context = ssl.create_default_context(cafile=ca_file)
        if skip_verify:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        return request_json(
            method, f"{url.rstrip('/')}{path}", body, headers, context, _retries(), TIMEOUT_S
        )
    except HttpRefused as err:
        raise PrefectError(f"{method} {path}: {err}", err.status) from None
    except Unreachable as err:
        raise PrefectError(f"the Prefect server at {url} cannot be reached ({err})") from None


def _retries() -> Retries:
    """Prefect's client's retry settings."""
    try:
        count = max(int(os.environ.get("PREFECT_CLIENT_MAX_RETRIES", "5")), 0)
    except ValueError:
        count = 5
    extra = os.environ.get("PREFECT_CLIENT_RETRY_EXTRA_CODES", "")
    codes = {408, 429, 502, 503} | {int(c) for c in extra.split(",") if c.strip().isdigit()}
    return Retries(count, frozenset(codes))


def read_flow_run(flow_run_id: uuid.UUID | str) -> FlowRun:
    """The flow run; ``PrefectError`` with status 404 when there is none."""
    return FlowRun.from_json(_request("GET", f"/flow_runs/{flow_run_id}"))


def create_deployment_run(
    deployment: str, parameters: dict[str, Any], tags: list[str] | None = None
) -> FlowRun:
    """A new flow run of ``deployment`` (``FLOW/NAME``), Scheduled for now, not waited for:
    the two requests of Prefect's ``run_deployment(..., timeout=0)`` outside a flow."""
    import urllib.parse

    flow_name, slash, name = deployment.partition("/")
    if not slash or not flow_name or not name:
        raise PrefectError(f"deployment {deployment!r}: give it as FLOW/NAME")
    quoted = "/".join(urllib.parse.quote(part, safe="") for part in (flow_name, name))
    found = _request("GET", f"/deployments/name/{quoted}")
    now = datetime.datetime.now(datetime.UTC).isoformat()
    body = {
        "parameters": parameters,
        "context": {},
        "state": {
            "type": "SCHEDULED",
            "name": "Scheduled",
            "message": None,
            "data": None,
            "state_details": {"scheduled_time": now},
        },
        "tags": list(tags or []),
        "labels": {},
    }
    return FlowRun.from_json(_request("POST", f"/deployments/{found['id']}/create_flow_run", body))


def experiment_runs(limit: int) -> list[FlowRun]:
    """The newest ``limit`` flow runs of the experiment flow, newest first."""
    body = {
        "flows": {"name": {"any_": [EXPERIMENT_FLOW]}},
        "sort": "START_TIME_DESC",
        "limit": limit,
    }
    return [FlowRun.from_json(run) for run in _request("POST", "/flow_runs/filter", body)]


def set_flow_run_state(
    flow_run_id: uuid.UUID | str, state_type: str, name: str, message: str, force: bool = False
) -> str:
    """Propose a state (``CANCELLED``, ...); returns the server's answer (ACCEPT, REJECT...)."""
    body = {"state": {"type": state_type, "name": name, "message": message}, "force": force}
    result = _request("POST", f"/flow_runs/{flow_run_id}/set_state", body)
    return str((result or {}).get("status", ""))


def update_flow_run_parameters(flow_run_id: uuid.UUID | str, parameters: dict[str, Any]) -> None:
    """Replace a flow run's parameters (what its next run, a resume or a retry, gets)."""
    _request("PATCH", f"/flow_runs/{flow_run_id}", {"parameters": parameters})


def resume_flow_run(flow_run_id: uuid.UUID | str) -> None:
    """Resume a paused (suspended) flow run, as Prefect's ``resume_flow_run`` does."""
    result = _request("POST", f"/flow_runs/{flow_run_id}/resume", {"run_input": None}) or {}
    if result.get("status") == "REJECT":
        state = (result.get("state") or {}).get("type")
        reason = (result.get("details") or {}).get("reason") or "no reason given"
        if state == "FAILED":
            raise PrefectError(f"flow run {flow_run_id} can no longer be resumed ({reason})")
        raise PrefectError(f"the Prefect server refused to resume flow run {flow_run_id}: {reason}")


def read_logs(
    flow_run_id: uuid.UUID | str, offset: int, task_run_ids: list[str] | None = None
) -> list[dict[str, Any]]:
    """The flow run's log records from ``offset`` on, oldest first, a page at a time (the
    server's default page, as Prefect's ``read_logs`` without a limit); with
    ``task_run_ids``, only those task runs' records."""
    logs: dict[str, Any] = {"flow_run_id": {"any_": [str(flow_run_id)]}}
    if task_run_ids is not None:
        logs["task_run_id"] = {"any_": task_run_ids}
    body = {"logs": logs, "offset": offset, "sort": "TIMESTAMP_ASC"}
    return list(_request("POST", "/logs/filter", body) or [])


def task_run_ids(flow_run_id: uuid.UUID | str, name_contains: str) -> list[str]:
    """The ids of the flow run's task runs whose name contains ``name_contains``."""
    body = {
        "flow_runs": {"id": {"any_": [str(flow_run_id)]}},
        "task_runs": {"name": {"like_": name_contains}},
    }
    runs = _request("POST", "/task_runs/filter", body) or []
    return [str(run["id"]) for run in runs if name_contains in str(run.get("name", ""))]
