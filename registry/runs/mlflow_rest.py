"""MLflow's tracking server, read over its REST API with the standard library.

Importing MLflow's client costs a command 1-4 s before its first request; what ``det``'s
listings read (experiments, runs with their tags and latest metrics, metric histories,
registered models and their versions) is a handful of small JSON requests.
``MlflowReader`` answers the read calls of ``MlflowClient`` they use, with the same names
and the fields read from its results, so the views (registry.experiments.view) take either.
``reader_for`` gives it for a plain ``http(s)://`` server whose credentials are a user and
password, a token, or none (with MLflow's TLS settings), and MLflow's own client for
anything else (a database URI, AWS SigV4, an auth plugin, Databricks, workspaces, a model
registry elsewhere).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import ssl
import urllib.parse
from typing import Any

from registry.servers.json_http import HttpRefused, Retries, Unreachable, request_json
from registry.servers.mlflow_errors import MlflowReaderError

__all__ = [
    "Experiment",
    "Metric",
    "MlflowReader",
    "MlflowReaderError",
    "MlflowRestClient",
    "ModelVersion",
    "RegisteredModel",
    "Run",
    "RunData",
    "RunInfo",
    "reader_for",
    "writer_for",
]

TIMEOUT_S = 30.0
MAX_RESULTS = 1000  # MlflowClient.search_runs' and search_experiments' default page
HISTORY_PAGE = 25_000
REGISTRY_PAGE = 1000  # registered models per page (the server's most)
VERSIONS_PAGE = 10_000  # MlflowClient.search_model_versions' default page
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})  # as MLflow's client retries
# Settings only MLflow's own client honours: with any of them set, it is used.
CLIENT_ONLY_SETTINGS = (
    "MLFLOW_TRACKING_AUTH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_WORKSPACE",
    "MLFLOW_ENABLE_WORKSPACES",
)


@dataclasses.dataclass(frozen=True)
class Experiment:
    experiment_id: str
    name: str
    lifecycle_stage: str = "active"
    tags: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Experiment:
        return cls(
            str(data["experiment_id"]),
            str(data["name"]),
            str(data.get("lifecycle_stage") or "active"),
            {t["key"]: str(t.get("value", "")) for t in data.get("tags") or []},
        )


@dataclasses.dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_name: str
    experiment_id: str
    status: str
    start_time: int | None
    end_time: int | None
    artifact_uri: str


@dataclasses.dataclass(frozen=True)
class RunData:
    tags: dict[str, str]
    metrics: dict[str, float]  # each key's latest value (MLflow's: at its largest step)
    params: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Run:
    info: RunInfo
    data: RunData

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        info, values = data.get("info") or {}, data.get("data") or {}
        return cls(
            RunInfo(
                run_id=str(info.get("run_id") or info.get("run_uuid")),
                run_name=str(info.get("run_name") or ""),
                experiment_id=str(info.get("experiment_id")),
                status=str(info.get("status") or ""),
                start_time=_int_or_none(info.get("start_time")),
                end_time=_int_or_none(info.get("end_time")),
                artifact_uri=str(info.get("artifact_uri") or ""),
            ),
            RunData(
                tags={t["key"]: str(t.get("value", "")) for t in values.get("tags") or []},
                metrics={m["key"]: float(m["value"]) for m in values.get("metrics") or []},
                params={p["key"]: str(p.get("value", "")) for p in values.get("params") or []},
            ),
        )


class RunPage(list[Run]):
    """A page of ``search_runs``; ``token`` names the next page (None on the last)."""

    token: str | None = None


@dataclasses.dataclass(frozen=True)
class Metric:
    key: str
    value: float  # NaN and infinities come as MLflow's JSON strings: float() reads them
    step: int
    timestamp: int


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    name: str
    aliases: dict[str, str]  # alias -> version, as MlflowClient's RegisteredModel.aliases

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RegisteredModel:
        aliases = {str(a["alias"]): str(a["version"]) for a in data.get("aliases") or []}
        return cls(str(data["name"]), aliases)


@dataclasses.dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    source: str
    run_id: str


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


class MlflowReader:
    """The read calls of ``MlflowClient`` that the views use, over REST."""

    def __init__(self, tracking_uri: str, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.host = tracking_uri.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        user, password = env.get("MLFLOW_TRACKING_USERNAME"), env.get("MLFLOW_TRACKING_PASSWORD")
        if user and password:
            basic = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._headers["Authorization"] = f"Basic {basic}"
        elif env.get("MLFLOW_TRACKING_TOKEN"):
            self._headers["Authorization"] = f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
        try:  # MLflow's client retries these 7 times, over minutes; a listing, 5 (31 s)
            count = int(env.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5"))
        except ValueError:
            count = 5
        self._retries = Retries(max(count, 0), RETRIED_STATUSES, first_s=1.0)
        self._context: ssl.SSLContext | None = None
        if self.host.startswith("https://"):
            self._context = ssl.create_default_context(
                cafile=env.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None
            )
            if env.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
                self._context.check_hostname = False
                self._context.verify_mode = ssl.CERT_NONE

    # ---- the MlflowClient calls -----------------------------------------------------
    def search_experiments(self, max_results: int = MAX_RESULTS) -> list[Experiment]:
        body = {"max_results": max_results, "view_type": "ACTIVE_ONLY"}
        found = self._call("POST", "experiments/search", body).get("experiments") or []
        return [Experiment.from_json(e) for e in found]

    def get_experiment(self, experiment_id: str) -> Experiment:
        found = self._call("GET", "experiments/get", {"experiment_id": experiment_id})
        return Experiment.from_json(found["experiment"])

    def get_experiment_by_name(self, name: str) -> Experiment | None:
        try:
            found = self._call("GET", "experiments/get-by-name", {"experiment_name": name})
        except MlflowReaderError as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return Experiment.from_json(found["experiment"])

    def search_runs(
        self,
        experiment_ids: list[str],
        filter_string: str = "",
        max_results: int = MAX_RESULTS,
        order_by: list[str] | None = None,
        page_token: str | None = None,
    ) -> RunPage:
        """One page of runs; its ``token`` asks for the next (None: the last), as
        MlflowClient's PagedList."""
        body: dict[str, Any] = {
            "experiment_ids": list(experiment_ids),
            "filter": filter_string,
            "max_results": max_results,
            "run_view_type": "ACTIVE_ONLY",
        }
        if order_by:
            body["order_by"] = list(order_by)
        if page_token:
            body["page_token"] = page_token
        answer = self._call("POST", "runs/search", body)
        page = RunPage(Run.from_json(run) for run in answer.get("runs") or [])
        page.token = answer.get("next_page_token") or None
        return page

    def get_run(self, run_id: str) -> Run:
        return Run.from_json(self._call("GET", "runs/get", {"run_id": run_id})["run"])

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        points: list[Metric] = []
        token: str | None = None
        while True:
            query = {"run_id": run_id, "metric_key": key, "max_results": str(HISTORY_PAGE)}
            if token:
                query["page_token"] = token
            page = self._call("GET", "metrics/get-history", query)
            points += [
                Metric(m["key"], float(m["value"]), int(m.get("step", 0)), int(m["timestamp"]))
                for m in page.get("metrics") or []
            ]
            token = page.get("next_page_token")
            if not token:
                return points

    # ---- the model registry (MLFLOW_REGISTRY_URI unset: the tracking server's) ------
    def search_registered_models(self) -> list[RegisteredModel]:
        """Every registered model (each page; MlflowClient's call returns the first)."""
        found = self._pages("registered-models/search", "registered_models", {}, REGISTRY_PAGE)
        return [RegisteredModel.from_json(m) for m in found]

    def get_registered_model(self, name: str) -> RegisteredModel:
        found = self._call("GET", "registered-models/get", {"name": name})
        return RegisteredModel.from_json(found["registered_model"])

    def search_model_versions(self, filter_string: str) -> list[ModelVersion]:
        query = {"filter": filter_string}
        found = self._pages("model-versions/search", "model_versions", query, VERSIONS_PAGE)
        return [
            ModelVersion(
                str(v["name"]),
                str(v["version"]),
                str(v.get("source") or ""),
                str(v.get("run_id") or ""),
            )
            for v in found
        ]

    def _pages(
        self, endpoint: str, key: str, query: dict[str, str], size: int
    ) -> list[dict[str, Any]]:
        """The ``key`` items of every page a GET search returns."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            asked = {**query, "max_results": str(size)}
            if token:
                asked["page_token"] = token
            page = self._call("GET", endpoint, asked)
            items += page.get(key) or []
            token = page.get("next_page_token")
            if not token:
                return items

    # ---- the wire -------------------------------------------------------------------
    def _call(self, method: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.host}/api/2.0/mlflow/{endpoint}"
        sent: dict[str, Any] | None = body
        if method == "GET":
            url, sent = f"{url}?{urllib.parse.urlencode(body)}", None
        try:
            answer = request_json(
                method, url, sent, self._headers, self._context, self._retries, TIMEOUT_S
            )
        except HttpRefused as err:
            raise _refused(err, endpoint) from None
        except Unreachable as err:
            raise MlflowReaderError(
                f"the MLflow server at {self.host} cannot be reached ({err}); is the stack "
                "up (make up) and MLFLOW_TRACKING_URI right?"
            ) from None
        return dict(answer or {})


class MlflowRestClient(MlflowReader):
    """The reader, and the few writes that make an experiment (registry.runs.experiment_setup):
    MlflowClient's names and arguments."""

    def create_experiment(
        self, name: str, artifact_location: str | None = None, tags: dict[str, str] | None = None
    ) -> str:
        body: dict[str, Any] = {"name": name, "tags": _key_values(tags or {})}
        if artifact_location:
            body["artifact_location"] = artifact_location
        return str(self._call("POST", "experiments/create", body)["experiment_id"])

    def restore_experiment(self, experiment_id: str) -> None:
        self._call("POST", "experiments/restore", {"experiment_id": experiment_id})

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        body = {"experiment_id": experiment_id, "key": key, "value": value}
        self._call("POST", "experiments/set-experiment-tag", body)


def _key_values(tags: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": str(v)} for k, v in tags.items()]


def _refused(err: HttpRefused, endpoint: str) -> MlflowReaderError:
    try:
        answer = json.loads(err.text)
    except ValueError:
        answer = {}
    code = answer.get("error_code") if isinstance(answer, dict) else None
    message = (answer.get("message") if isinstance(answer, dict) else None) or err.text[:300]
    if err.status in (401, 403):
        message += " (check MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN)"
    return MlflowReaderError(f"MLflow {endpoint}: HTTP {err.status} {message}", code)


def _rest_serves(tracking_uri: str) -> bool:
    """Whether REST calls can stand in for MLflow's client here: a plain HTTP(S) server,
    no client-only setting, the model registry on the same server."""
    plain = tracking_uri.startswith(("http://", "https://"))
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or ""
    elsewhere = bool(registry) and registry.rstrip("/") != tracking_uri.rstrip("/")
    return plain and not elsewhere and not any(os.environ.get(n) for n in CLIENT_ONLY_SETTINGS)


def reader_for(tracking_uri: str) -> Any:
    """``MlflowReader`` for a plain HTTP(S) tracking server, else ``MlflowClient`` (also
    when the model registry is elsewhere: MLFLOW_REGISTRY_URI)."""
    if _rest_serves(tracking_uri):
        return MlflowReader(tracking_uri)
    from registry.runs.tracking import client_for

    return client_for(tracking_uri)


def writer_for(tracking_uri: str) -> Any:
    """``MlflowRestClient`` where ``reader_for`` reads over REST, else ``MlflowClient``."""
    if _rest_serves(tracking_uri):
        return MlflowRestClient(tracking_uri)
    from registry.runs.tracking import client_for

    return client_for(tracking_uri)
