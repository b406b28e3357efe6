"""`det`'s listings read Prefect and MLflow over their REST APIs with the standard library
(flows.prefect_rest, registry.runs.mlflow_rest) and the light run records
(registry.runs.run_records), so they answer without importing MLflow, Prefect, Dask or
torch. Here against a small HTTP server that answers as Prefect 3.8 and MLflow 3.17 do
(their JSON shapes), holding the issue's killed experiment: describe, list-trials, list-
checkpoints and trial describe show the numbers MLflow holds, in Determined's spelling, in
batch order. The light copies of what the writers' modules define are pinned to them."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from det_tasks.errors import DetTasksError
from flows import prefect_rest
from registry.runs import run_records
from registry.runs.mlflow_rest import MlflowReader, MlflowReaderError, reader_for
from registry.servers import json_http

ROOT = Path(__file__).resolve().parents[2]
FLOW_RUN = uuid.UUID("1a2b3c4d-0000-4000-8000-000000000001")
SHORT = str(FLOW_RUN)[:8]
HEAVY = ("mlflow", "prefect", "torch", "distributed", "dask", "httpx", "pydantic", "pandas")
# The killed trial: 14 validations (best 0.0173 at 528), checkpoints at 132, 88, 44
# and 1390 (recorded in that order), trained to 1650.
HISTORY = [(44 * i, round(0.05 - 0.002 * i, 4)) for i in range(1, 12)]
HISTORY += [(528, 0.0173), (1100, "NaN"), (1628, 0.0195)]


def _tags(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in values.items()]


def _record(step: int, value: float | None = None) -> str:
    metrics = {} if value is None else {"validation_loss": value}
    return json.dumps(
        {
            "uuid": f"u{step}",
            "steps_completed": step,
            "uri": f"s3://b/c{step}",
            "validation_metrics": metrics,
        }
    )


PARENT = {
    "info": {"run_id": "p" * 32, "experiment_id": "7", "status": "KILLED", "run_name": "xor"},
    "data": {
        "tags": _tags(
            {
                "det.experiment_run": str(FLOW_RUN),
                "det.searcher.metric": "validation_loss",
                "det.searcher.smaller_is_better": "True",
                "det.state": "CANCELED",
                "det.best.validation_loss": "0.0173",  # kept by registry.experiments.summary
            }
        )
    },
}
TRIAL = {
    "info": {"run_id": "t" * 32, "experiment_id": "7", "status": "KILLED", "run_name": "trial-1"},
    "data": {
        "tags": _tags(
            {
                "det.trial_id": "1",
                "mlflow.parentRunId": "p" * 32,
                "det.state": "CANCELED",
                **{
                    f"det.checkpoint.u{s}": _record(s, v)
                    for s, v in ((132, 0.031), (88, 0.0344), (44, 0.048), (1390, None))
                },
            }
        ),
        "metrics": [{"key": "progress/batches", "value": 1650, "step": 1650, "timestamp": 9}],
        "params": [{"key": "hp.learning_rate", "value": "0.1"}],
    },
}


class FakeServers(BaseHTTPRequestHandler):
    """Prefect's API under /api, MLflow's under /api/2.0/mlflow, as they answer."""

    flow_state = "CANCELLED"
    requests: list[str] = []  # one server per test: the fixture empties it

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        FakeServers.requests.append(f"GET {url.path}")
        if url.path == "/api/health":
            return self._send(True)
        if url.path == f"/api/flow_runs/{FLOW_RUN}":
            return self._send(self._flow_run())
        if url.path.startswith("/api/flow_runs/"):
            return self._send({"detail": "Flow run not found"}, 404)
        if url.path == "/api/2.0/mlflow/runs/get":
            run = {PARENT["info"]["run_id"]: PARENT, TRIAL["info"]["run_id"]: TRIAL}.get(
                query["run_id"]
            )
            if run is None:
                return self._send({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"}, 404)
            return self._send({"run": run})
        if url.path == "/api/2.0/mlflow/metrics/get-history":
            assert query["metric_key"] == "validation/validation_loss"
            start = int(query.get("page_token") or 0)
            page = HISTORY[start : start + 5]  # pages of 5: the reader must follow them
            body: dict[str, Any] = {
                "metrics": [
                    {"key": "validation/validation_loss", "value": v, "step": s, "timestamp": i}
                    for i, (s, v) in enumerate(page, start)
                ]
            }
            if start + 5 < len(HISTORY):
                body["next_page_token"] = str(start + 5)
            return self._send(body)
        return self._send({"detail": "not here"}, 404)

    def do_POST(self) -> None:
        body = self._body()
        FakeServers.requests.append(f"POST {self.path}")
        if self.path == "/api/flow_runs/filter":
            return self._send([self._flow_run()])
        if self.path == "/api/2.0/mlflow/experiments/search":
            return self._send({"experiments": [{"experiment_id": "7", "name": "xor"}]})
        if self.path == "/api/2.0/mlflow/runs/search":
            wanted = re.findall(r"tags\.`([^`]+)` = '([^']*)'", body["filter"])
            runs = [
                r
                for r in (PARENT, TRIAL)
                if all({"key": k, "value": v} in r["data"]["tags"] for k, v in wanted)
            ]
            if "status = 'RUNNING'" in body["filter"]:
                runs = []
            return self._send({"runs": runs[: body["max_results"]]})
        return self._send({"detail": "not here"}, 404)

    def _flow_run(self) -> dict[str, Any]:
        return {
            "id": str(FLOW_RUN),
            "name": "clever-fox",
            "state_type": self.flow_state,
            "state_name": "Cancelled",
            "state": {"type": self.flow_state, "name": "Cancelled", "message": "killed"},
            "parameters": {"config": "xor.yaml"},
            "start_time": "2026-11-26T21:58:17.123456Z",
        }


@pytest.fixture(autouse=True)
def environment_settings(monkeypatch):
    """flows.prefect_rest reads the environment, as in `det` (where Prefect is not loaded),
    though other tests in this process may have loaded Prefect."""
    monkeypatch.setattr(prefect_rest, "prefect_loaded", lambda: False)


@pytest.fixture
def servers() -> Iterator[str]:
    FakeServers.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _platform_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DET_"))}
    return {**env, "PREFECT_API_URL": f"{url}/api", "MLFLOW_TRACKING_URI": url,
            "DET_TASKS_STACK_DIR": "/nonexistent", "PYTHONPATH": str(ROOT)}  # fmt: skip


def det_alone(url: str, *argv: str) -> tuple[int, str, list[str]]:
    """``det ARGV`` in a fresh interpreter: (exit code, output, heavy modules it loaded)."""
    code = (
        "import sys, json; from det_cli import main; rc = main(sys.argv[1:]); "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=_platform_env(url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    *lines, loaded = done.stdout.rstrip("\n").split("\n")
    assert done.returncode == 0, done.stderr
    return 0, "\n".join(lines) + "\n" + done.stderr, json.loads(loaded)


def _row(out: str, first: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(first))


def test_describe_shows_mlflows_numbers_in_determineds_words_without_heavy_imports(servers):
    _, out, loaded = det_alone(servers, "experiment", "describe", SHORT)
    assert loaded == []
    assert "GET /api/2.0/mlflow/runs/get" not in FakeServers.requests  # search results do
    assert f"experiment run {SHORT}: CANCELED" in out and "CANCELLED" not in out
    header = out.splitlines()[3].split()
    assert header[:6] == ["trial", "state", "batches", "best", "validation_loss", "at"]
    row = _row(out, "1 ")
    assert row[:6] == ["1", "CANCELED", "1650", "0.0173", "528", "0.0195"]
    assert "best: trial 1, validation_loss=0.0173 at batch 528, s3://b/c132" in out


def test_list_trials_and_trial_describe_agree_with_describe(servers):
    _, out, loaded = det_alone(servers, "experiment", "list-trials", SHORT)
    assert loaded == []
    assert _row(out, f"{SHORT}/1")[1:6] == ["CANCELED", "1650", "0.0173", "528", "0.0195"]
    _, out, loaded = det_alone(servers, "trial", "describe", f"{SHORT}/1")
    assert loaded == []
    assert f"trial {SHORT}/1: CANCELED, 1650 batches" in out
    assert "best validation_loss: 0.0173 at batch 528" in out
    assert "latest validation_loss: 0.0195 at batch 1628" in out
    assert "hparam learning_rate = 0.1" in out


def test_list_checkpoints_in_batch_order(servers):
    _, out, loaded = det_alone(servers, "experiment", "list-checkpoints", SHORT)
    assert loaded == []
    batches = [line.split()[1] for line in out.splitlines()[2:] if line.startswith("trial-1")]
    assert batches == ["44", "88", "132", "1390"]
    _, out, _ = det_alone(servers, "experiment", "lc", SHORT, "--best", "2")
    batches = [line.split()[1] for line in out.splitlines()[2:] if line.startswith("trial-1")]
    assert batches == ["88", "132"]  # the best two, in batch order


def test_list_shows_the_state_in_determineds_words(servers):
    _, out, loaded = det_alone(servers, "experiment", "list")
    assert loaded == []
    row = _row(out, SHORT)
    assert row[1:3] == ["xor", "CANCELED"] and "validation_loss=0.0173" in row


def test_prefect_rest_reads_runs_and_says_what_failed(servers, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", f"{servers}/api")
    run = prefect_rest.read_flow_run(FLOW_RUN)
    assert (run.id, run.state, run.state_message) == (FLOW_RUN, "CANCELLED", "killed")
    assert run.start_time is not None and run.start_time.year == 2026
    assert prefect_rest.experiment_state(run.state) == "CANCELED"
    with pytest.raises(prefect_rest.PrefectError) as missing:
        prefect_rest.read_flow_run(uuid.uuid4())
    assert missing.value.status == 404
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    with pytest.raises(prefect_rest.PrefectError, match=r"http://127.0.0.1:1/api cannot be"):
        prefect_rest.experiment_runs(5)
    states = prefect_rest.EXPERIMENT_STATES
    assert {states[s] for s in ("SCHEDULED", "PENDING", "RUNNING")} == {"ACTIVE"}
    assert (states["CANCELLED"], states["CRASHED"], states["PAUSED"]) == (
        "CANCELED",
        "ERROR",
        "PAUSED",
    )


def test_prefect_rest_sends_prefects_credentials(monkeypatch, tmp_path):
    """From the environment, else the active Prefect profile (as Prefect's client)."""
    seen: list[str | None] = []

    class Auth(FakeServers):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Auth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{server.server_address[1]}/api")
        for name in ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
        (tmp_path / "profiles.toml").write_text(
            'active = "team"\n[profiles.team]\nPREFECT_API_AUTH_STRING = "team:secret"\n'
        )
        prefect_rest.read_flow_run(FLOW_RUN)
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:pass")
        prefect_rest.read_flow_run(FLOW_RUN)
        monkeypatch.setenv("PREFECT_API_KEY", "pnu_key")
        prefect_rest.read_flow_run(FLOW_RUN)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Basic dGVhbTpzZWNyZXQ=", "Basic YWRtaW46cGFzcw==", "Bearer pnu_key"]


def test_mlflow_reader_reads_as_mlflows_client_does(servers):
    reader = MlflowReader(servers, environ={})
    run = reader.get_run("t" * 32)
    assert run.info.status == "KILLED" and run.data.metrics["progress/batches"] == 1650.0
    assert run.data.params == {"hp.learning_rate": "0.1"}
    history = reader.get_metric_history("t" * 32, "validation/validation_loss")
    assert [m.step for m in history] == [s for s, _ in HISTORY]  # all pages
    assert math.isnan(history[-2].value)  # MLflow's JSON spells NaN "NaN"
    with pytest.raises(MlflowReaderError) as missing:
        reader.get_run("x" * 32)
    assert missing.value.error_code == "RESOURCE_DOES_NOT_EXIST"
    with pytest.raises(MlflowReaderError, match="cannot be reached"):
        MlflowReader("http://127.0.0.1:1", environ={}).search_experiments()


def test_reader_for_keeps_mlflows_client_where_only_it_knows_how(monkeypatch):
    from registry.runs import tracking

    monkeypatch.setattr(tracking, "client_for", lambda uri: f"MlflowClient({uri})")
    monkeypatch.delenv("MLFLOW_TRACKING_AUTH", raising=False)
    assert isinstance(reader_for("http://127.0.0.1:5001"), MlflowReader)
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "my_plugin")
    assert reader_for("http://127.0.0.1:5001") == "MlflowClient(http://127.0.0.1:5001)"
    monkeypatch.delenv("MLFLOW_TRACKING_AUTH")
    assert reader_for("sqlite:///x.db") == "MlflowClient(sqlite:///x.db)"


def test_the_light_copies_agree_with_the_writers_modules():
    """registry.runs.run_records repeats what heavy modules define (importing those costs a
    command seconds); they must not drift apart."""
    from registry.checkpoints import store as checkpoints
    from registry.runs import large_tags, run_states, tracking

    assert run_records.TRIAL_TAG == tracking.TRIAL_TAG
    assert run_records.EXPERIMENT_RUN_TAG == tracking.EXPERIMENT_RUN_TAG
    assert run_records.STATE_TAG == tracking.STATE_TAG
    assert run_records.HEARTBEAT_TAG == tracking.HEARTBEAT_TAG
    assert run_records.PARENT_TAG == tracking.PARENT_TAG
    assert run_records.CHECKPOINT_TAG == checkpoints.CHECKPOINT_TAG
    assert run_records.FLOW_PROCESS_TAG == run_states.FLOW_PROCESS_TAG
    assert run_records.ORPHAN_AFTER_S == run_states.ORPHAN_AFTER_S
    text = json.dumps({"config": "x" * 40_000, "n": list(range(3000))})
    tags = {**large_tags.large_tag("det.checkpoint.big", text), "det.checkpoint.small": "{}"}
    assert len(tags) > 2  # split into chunks
    assert run_records.load_large_tags(tags, "det.checkpoint.") == large_tags.load_large_tags(
        tags, "det.checkpoint."
    )
    records = [json.loads(_record(s, v)) for s, v in ((1, 0.3), (2, None), (3, 0.1), (4, 0.2))]
    for smaller in (True, False):
        assert run_records.rank_by_metric(records, "validation_loss", smaller) == (
            checkpoints.rank_by_metric(records, "validation_loss", smaller)
        )


def test_orphaned_is_the_rule_end_orphans_applies():
    import socket
    import types

    from registry.runs.run_states import flow_gone

    def parent(beat: float, process: str) -> Any:
        tags = {"det.heartbeat": f"{beat:.0f}", "det.flow_process": process}
        return types.SimpleNamespace(data=types.SimpleNamespace(tags=tags))

    here = socket.gethostname()
    me = run_states_process()
    for beat, process in ((1000.0, me), (1000.0, "elsewhere 1 1.00"), (1000.0, f"{here} 1 1.00"),
                          (1000.0, f"{here} 999999999 1.00"), (900.0, me)):  # fmt: skip
        p = parent(beat, process)
        expected = 1030.0 - beat > run_records.ORPHAN_AFTER_S or flow_gone(p)
        assert run_records.orphaned(p, now=1030.0) == expected, process


def run_states_process() -> str:
    from registry.runs.run_states import this_process

    return this_process()


def test_bad_ids_and_absent_servers_are_one_line(servers, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", f"{servers}/api")
    from det_cli.submission import find_flow_run

    with pytest.raises(DetTasksError, match="no experiment run with id"):
        find_flow_run(str(uuid.uuid4()))
    assert find_flow_run(SHORT).id == FLOW_RUN


def test_prefect_rest_retries_what_prefects_client_retries(monkeypatch):
    """A busy server's 503 (the stack's SQLite under load) is sent again, as Prefect's
    client does; other refusals are not."""
    answers = [503, 503, 200]
    seen: list[int] = []

    class Busy(FakeServers):
        def do_POST(self) -> None:
            seen.append(answers[0])
            status = answers.pop(0) if len(answers) > 1 else answers[0]
            if status == 200:
                return super().do_POST()
            self._body()
            return self._send({"exception_message": "Service Unavailable"}, status)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    waits: list[float] = []
    monkeypatch.setattr(json_http.time, "sleep", waits.append)
    try:
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{server.server_address[1]}/api")
        assert [r.id for r in prefect_rest.experiment_runs(5)] == [FLOW_RUN]
        assert seen == [503, 503, 200] and 2.0 <= waits[0] <= 2.4 and 4.0 <= waits[1] <= 4.8
        monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "0")
        answers[:] = [503, 503]
        with pytest.raises(prefect_rest.PrefectError, match="HTTP 503") as refused:
            prefect_rest.experiment_runs(5)
        assert refused.value.status == 503
    finally:
        server.shutdown()
        server.server_close()


def test_list_ends_orphans_through_mlflows_client_only_when_there_are_some(monkeypatch):
    """`det experiment list` finds runs whose flow is gone through the REST reader (the rule
    of registry.runs.run_states.end_orphans) and loads MLflow's client only to end them."""
    import time
    import types

    from registry import cli
    from registry.runs import run_states

    def parent(experiment_id: str, beat: float) -> Any:
        tags = {"det.heartbeat": f"{beat:.0f}", "det.flow_process": "elsewhere 1 1.00"}
        return types.SimpleNamespace(
            info=types.SimpleNamespace(experiment_id=experiment_id),
            data=types.SimpleNamespace(tags=tags),
        )

    running = [parent("3", time.time()), parent("4", time.time() - 600)]
    reader = types.SimpleNamespace(
        search_experiments=lambda: [types.SimpleNamespace(experiment_id=e) for e in "34"],
        search_runs=lambda ids, filter_string, max_results: list(running),
    )
    ended: list[tuple[Any, list[str]]] = []
    monkeypatch.setattr(cli, "tracking_client_from_env", lambda: "mlflow-client")
    monkeypatch.setattr(
        run_states, "end_orphans", lambda client, ids: ended.append((client, ids)) or ["p4"]
    )
    assert cli.end_orphans_seen(reader) == ["p4"]
    assert ended == [("mlflow-client", ["4"])]
    running.pop()
    assert cli.end_orphans_seen(reader) == [] and len(ended) == 1
