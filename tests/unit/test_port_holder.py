"""The embedded scheduler's port is kept from other sockets until the scheduler binds it
(cluster.startup.hold_free_port, Linux), and a cluster that fails to start is reported at
once, naming its cause: a start failed once after the flow's client had been refused for 30 s."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
import time
from collections.abc import Iterator

import pytest
from tornado import netutil

from cluster import startup
from cluster.startup import SCHEDULER_ENV, background_cluster, hold_free_port

LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="elsewhere the port cannot be held"
)


def _plain_bind_error(port: int) -> int | None:
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError as err:
            return err.errno
    return None


def _connect_within(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=seconds).close()
            return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@LINUX_ONLY
def test_held_port_is_refused_to_others_and_never_handed_out() -> None:
    port, holder = hold_free_port()
    assert holder is not None
    try:
        assert _plain_bind_error(port) == errno.EADDRINUSE
        handed: set[int] = set()
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(512)
            for _ in range(500):  # Linux picks these local ports as it picks probed ones
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    handed.add(probe.getsockname()[1])
                with socket.create_connection(server.getsockname()) as conn:
                    handed.add(conn.getsockname()[1])
                    server.accept()[0].close()
        assert port not in handed
    finally:
        holder.close()
    assert _plain_bind_error(port) is None  # closed: free again


@LINUX_ONLY
def test_a_server_binds_and_serves_the_held_port() -> None:
    port, holder = hold_free_port()
    assert holder is not None
    (listener,) = netutil.bind_sockets(port, address="127.0.0.1")  # as Dask's TCP listener
    try:
        listener.listen(8)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = listener.accept()
            accepted.close()
    finally:
        listener.close()
        holder.close()


def _fake_cluster(
    monkeypatch: pytest.MonkeyPatch, workers_start_s: float = 0.0
) -> dict[str, object]:
    """embedded_cluster as far as the port goes: its scheduler listens on it (as Dask's,
    through tornado), then its workers take ``workers_start_s`` to start. Returns what it
    saw: whether the port was held before the scheduler bound it."""
    seen: dict[str, object] = {}

    @contextlib.contextmanager
    def cluster(n_workers: int, gpu_slots: int, port: int) -> Iterator[None]:
        seen["held while starting"] = _plain_bind_error(port)
        (listener,) = netutil.bind_sockets(port, address="127.0.0.1")
        listener.listen(8)
        try:
            time.sleep(workers_start_s)
            yield None
        finally:
            listener.close()

    monkeypatch.setattr(startup, "embedded_cluster", cluster)
    monkeypatch.setattr(startup, "workers_that_fit", lambda n: n)
    return seen


@LINUX_ONLY
def test_background_cluster_holds_its_port_until_the_scheduler_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _fake_cluster(monkeypatch)
    with background_cluster(1) as address:
        port = int(address.rsplit(":", 1)[1])
        _connect_within(port, 10.0)  # as Dask's client does: refused until it listens
        assert address == startup.os.environ[SCHEDULER_ENV]
    assert seen["held while starting"] == errno.EADDRINUSE
    assert _plain_bind_error(port) is None  # the holder is closed with the cluster


def test_a_cluster_that_fails_to_start_is_reported_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @contextlib.contextmanager
    def failing_cluster(n_workers: int, gpu_slots: int, port: int) -> Iterator[None]:
        raise OSError(errno.EADDRINUSE, "Address already in use")
        yield None  # a generator, as the real one

    monkeypatch.setattr(startup, "embedded_cluster", failing_cluster)
    monkeypatch.setattr(startup, "workers_that_fit", lambda n: n)
    started = time.monotonic()
    with (
        background_cluster(1) as address,
        pytest.raises(RuntimeError) as raised,
        startup.dask_client(1),
    ):
        pass
    # Named, with its cause, instead of 30 s of refused connections.
    assert time.monotonic() - started < 10
    assert str(raised.value) == (
        f"the embedded Dask cluster at {address} failed to start: "
        "OSError: [Errno 98] Address already in use; run the command again, or point "
        f"{SCHEDULER_ENV} at a running scheduler (`dask scheduler`)"
    )


def test_the_client_connects_once_the_scheduler_listens_not_after_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cluster(monkeypatch, workers_start_s=3.0)
    with background_cluster(1) as address:
        started = time.monotonic()
        startup._raise_if_it_failed_to_start(address)
        assert time.monotonic() - started < 2.0
