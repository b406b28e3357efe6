"""One spec for a det-tasks Dask worker (cluster.worker_spec): the stack's ``dask worker``
command (infra.dask_cluster) and the embedded cluster's Nanny workers (cluster.startup) are
both built from it, so they start the same worker: one step at a time, no Dask memory limit,
non-daemonic, the same threads, GPUs and resources. The stack's worker adds its pool and
its preload (the embedded one is in the default pool and warmed by its forkserver)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import dask
import pytest

from cluster import startup
from cluster.pools import POOL_ENV, worker_pool
from cluster.worker_spec import NANNY_SETTINGS, WORKER_DAEMON_ENV, WorkerSpec
from det_tasks.cpu_threads import WORKER_THREADS_ENV
from infra.dask_cluster import worker_service


def _as_nanny_options(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """What a ``dask worker`` command line (and its environment) asks of its Nanny, in
    ``distributed.Nanny``'s own keyword arguments."""
    at = argv.index("distributed.cli.dask_worker")
    args = argv[at + 2 :]  # after the scheduler's address
    values: dict[str, list[str]] = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        values.setdefault(flag.removeprefix("--"), []).append(value)
    assert values.pop("nworkers") == ["1"]  # one worker process per command
    options: dict[str, Any] = {
        "nthreads": int(values["nthreads"][0]),
        "memory_limit": int(values["memory-limit"][0]),
        "env": {k: v for k, v in env.items() if k in (WORKER_THREADS_ENV, "CUDA_VISIBLE_DEVICES")},
    }
    if "resources" in values:
        pairs = (item.split("=") for item in shlex.split(values["resources"][0]))
        options["resources"] = {name: int(count) for name, count in pairs}
    if "preload" in values:
        options["preload"] = values["preload"]
    return options


@pytest.mark.parametrize(
    "spec",
    [
        WorkerSpec(threads=2),
        WorkerSpec(threads=4, gpus=(2, 3), pool="gpus", preload=("cluster.held_trials",)),
        WorkerSpec(threads=1, gpus=()),  # sees no GPU
    ],
)
def test_the_command_line_and_the_nanny_say_the_same(tmp_path: Path, spec: WorkerSpec) -> None:
    argv = ["python", "-m", "distributed.cli.dask_worker", "tcp://127.0.0.1:1", *spec.cli_args()]
    env = spec.cli_env()
    assert _as_nanny_options(argv, env) == spec.nanny_options()
    assert (
        env[WORKER_DAEMON_ENV] == "False" and NANNY_SETTINGS["distributed.worker.daemon"] is False
    )


@pytest.fixture(autouse=True)
def _no_pool_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POOL_ENV, raising=False)  # the stack's workers then join "default"


def _stack_worker(tmp_path: Path, **kwargs: Any) -> dict[str, Any]:
    """The Nanny options of the stack's worker, read back from its command line."""
    service = worker_service(tmp_path, "tcp://127.0.0.1:1", "w", **kwargs)
    return _as_nanny_options(service.argv, service.env)


def test_the_stack_worker_is_the_spec_with_its_pool_and_preload(tmp_path: Path) -> None:
    assert _stack_worker(tmp_path, gpus=[3], threads=4) == {
        "nthreads": 1,
        "memory_limit": 0,
        "env": {WORKER_THREADS_ENV: "4", "CUDA_VISIBLE_DEVICES": "3"},
        "resources": {"pool-default": 1, "GPU": 1},
        "preload": ["cluster.held_trials"],
    }
    service = worker_service(tmp_path, "tcp://127.0.0.1:1", "w")
    assert service.env[WORKER_DAEMON_ENV] == "False"


class _Captured:
    """Stands in for a Dask cluster class: keeps what it was built with and the Dask
    settings in force then (the Nanny reads them as it starts a worker)."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any], bool]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        daemon = dask.config.get("distributed.worker.daemon")
        type(self).calls.append((args, kwargs, daemon))

    def __enter__(self) -> _Captured:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _embedded(monkeypatch: pytest.MonkeyPatch, gpus: int) -> dict[str, Any]:
    """What ``embedded_cluster(2)`` builds its cluster with on an 8-core host with ``gpus``
    GPUs; non-daemonic workers checked on the way."""
    _Captured.calls = []
    monkeypatch.setattr(startup, "_warm_forkserver", lambda: None)
    monkeypatch.setattr(startup, "gpu_count", lambda: gpus)
    monkeypatch.setattr(startup, "worker_share", lambda n: 8 // n)
    monkeypatch.setattr(startup, "SpecCluster", _Captured)
    monkeypatch.setattr(startup, "LocalCluster", _Captured)
    with startup.embedded_cluster(2, gpu_slots=1):
        pass
    [(_, kwargs, daemon)] = _Captured.calls
    assert daemon is False
    return kwargs


def test_an_embedded_gpu_worker_is_the_stack_worker_less_pool_and_preload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = _embedded(monkeypatch, gpus=2)
    embedded = {name: w["options"] for name, w in kwargs["workers"].items()}
    assert sorted(embedded) == ["gpu-0", "gpu-1"]
    stack = _stack_worker(tmp_path, gpus=[1], threads=4)
    assert {k: v for k, v in stack.items() if k != "preload"} == {
        **embedded["gpu-1"],
        "resources": {"pool-default": 1, "GPU": 1},
    }
    assert worker_pool(embedded["gpu-1"]["resources"]) == worker_pool(stack["resources"])


def test_an_embedded_cpu_worker_is_the_stack_worker_less_pool_and_preload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = _embedded(monkeypatch, gpus=0)
    embedded = {
        "nthreads": kwargs["threads_per_worker"],
        **{k: kwargs[k] for k in ("memory_limit", "env")},
    }
    assert kwargs["n_workers"] == 2 and kwargs["processes"] is True
    assert "resources" not in kwargs and "preload" not in kwargs
    stack = _stack_worker(tmp_path, threads=4)
    assert stack == {
        **embedded,
        "resources": {"pool-default": 1},
        "preload": ["cluster.held_trials"],
    }
    assert embedded == {"nthreads": 1, "memory_limit": 0, "env": {WORKER_THREADS_ENV: "4"}}


def test_the_quiet_diagnostics_reach_dask_as_settings_and_a_users_own_value_stays() -> None:
    """The stack's dask commands read QUIET_DIAGNOSTICS from their environment: each name
    is one Dask parses to the same setting, and one the user set is kept."""
    import dask.config

    from cluster.worker_spec import QUIET_DIAGNOSTICS, quiet_diagnostics_env

    parsed = dask.config.collect_env(quiet_diagnostics_env({}))
    for key, value in QUIET_DIAGNOSTICS.items():
        section: object = parsed
        for part in key.split("."):
            assert isinstance(section, dict)
            section = section.get(part, section.get(part.replace("-", "_")))
        assert section == value, key
    own = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True"}
    assert quiet_diagnostics_env(own)["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] == "True"


def test_the_embedded_cluster_runs_with_the_quiet_diagnostics() -> None:
    """Asked in a worker of the embedded cluster itself: the settings, and no profiler."""
    from distributed import get_worker

    from cluster.startup import background_cluster, dask_client

    def settings() -> tuple[object, object, bool]:
        return (
            dask.config.get("distributed.admin.tick.interval"),
            dask.config.get("distributed.admin.system-monitor.interval"),
            "profile" in get_worker().periodic_callbacks,
        )

    with background_cluster(1), dask_client(1) as client:
        assert client.submit(settings, pure=False).result() == ("1s", "5s", False)
