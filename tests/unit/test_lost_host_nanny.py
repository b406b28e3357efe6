"""A dead worker's death is explained from its Nanny's report, which a Nanny restarting it
sends within seconds; a lost host has no Nanny left, and is not waited for
(cluster.worker_deaths: the 10 s wait was most of a lost host's recovery)."""

from __future__ import annotations

import socket

from cluster.environment import accepts


def test_a_listening_nanny_answers_and_a_gone_one_does_not() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert accepts(f"tcp://127.0.0.1:{port}")
    assert not accepts(f"tcp://127.0.0.1:{port}")  # closed: refused at once
