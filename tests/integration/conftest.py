"""The real local stack (SeaweedFS + MLflow server), started once per test session by the
project's own infra/ code on ports of its own, and stopped at the end."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.services import is_running
from infra.stack import StackConfig, down, mlflow_service, stack_services, up
from tests.integration.helpers import environment, isolated_stack_config


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    pytest.importorskip("mlflow", reason="the platform extra is not installed")
    root = tmp_path_factory.mktemp("stack")
    config = isolated_stack_config(root)
    try:
        env = up(config)
    except BaseException:
        down(config)  # whatever did start must not outlive the session
        raise
    try:
        with environment(
            **env,
            DET_TASKS_CACHE_DIR=str(root / "cache"),
            PREFECT_HOME=str(root / "prefect-client"),
        ):
            _reload_prefect_settings()
            try:
                yield config
            finally:
                _flush_prefect_logs()
                down(config)
    finally:
        _reload_prefect_settings()  # with the session's own environment back


@pytest.fixture(autouse=True)
def _session_stack_whole(request: pytest.FixtureRequest) -> Iterator[None]:
    """The session's stack is every later test's: a test that leaves a service of it
    stopped has failed on its own, and the next one starts it again rather than every
    later test failing on a refused connection after MLflow's retries (CI of stop 55: one
    stack left down cost 28 tests and 50 minutes). A start that fails fails the test at
    once, naming the services."""
    if "stack" in request.fixturenames:
        config: StackConfig = request.getfixturevalue("stack")
        down_now = [s.name for s in stack_services(config) if not is_running(s)]
        if down_now:
            try:
                up(config)
            except Exception as error:  # reported as this test's failure
                pytest.fail(
                    f"the session's stack was left with {', '.join(down_now)} stopped and "
                    f"could not be started again: {error}"
                )
    yield


def _reload_prefect_settings() -> None:
    """Prefect reads its settings from the environment once, at import; a test module that
    imported it at collection would otherwise talk to an ephemeral server, not the stack's."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def _flush_prefect_logs() -> None:
    """Send buffered flow logs while the server is still up (no shutdown noise after)."""
    if "prefect.logging.handlers" not in sys.modules:  # no flow ran in this process
        return
    from flows.log_delivery import deliver_logs

    deliver_logs()


@pytest.fixture
def mlflow_server(stack: StackConfig):
    return mlflow_service(stack)


@pytest.fixture
def model_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "fixtures" / "determined_model"


@pytest.fixture(scope="session")
def hosts_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Real hosts on this machine (infra/hosts.py), built once for the multi-host tests:
    the stack on host 0's bridge address, a worker on each of hosts 1 and 2."""
    pytest.importorskip("mlflow", reason="the platform extra is not installed")
    from infra import hosts as hosts_lib
    from tests.integration.hosts_helpers import hosts_config, prefix

    with hosts_lib.running(hosts_config(tmp_path_factory.mktemp("hosts"), prefix("c"))) as cluster:
        yield cluster


@pytest.fixture
def cluster(hosts_cluster: Any) -> Any:
    """The hosts cluster with every link up and every worker running: a test that lost or
    cut a host leaves the next one the whole cluster."""
    hosts_cluster.heal()
    return hosts_cluster


@pytest.fixture(scope="session")
def hosts_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The killable XOR trial run undisturbed, once for every multi-host fault test to end
    bit-equal to (tests/integration/hosts_helpers.undisturbed_reference)."""
    from tests.integration.hosts_helpers import undisturbed_reference

    return undisturbed_reference(tmp_path_factory.mktemp("hosts-reference"))
