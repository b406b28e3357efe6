"""What the stack's flow-run starter (``flows.flow_starter``) and the pool's command
(``flows.engine_session``) say to each other over its Unix socket.

Standard library only: the pool's command imports this before anything else, and a flow
run that the starter takes must not pay for an import the starter has already done.

Each message is a 4-byte length and a JSON object. The command's request carries its
standard streams' file descriptors (``SCM_RIGHTS``), so the flow run writes where the
command would have written (the Prefect worker's pipe). The replies: ``{"pid": N}`` (the
flow run's process) then ``{"exit": CODE}`` (a negative code is the signal that ended it,
as ``os.waitstatus_to_exitcode`` gives), or ``{"refused": WHY}`` instead of both.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "FORWARDED_SIGNALS",
    "GO",
    "PROJECT",
    "STARTER_ENV",
    "STREAMS",
    "peer_uid",
    "process_traits",
    "receive",
    "receive_with_streams",
    "send",
    "send_with_streams",
    "socket_path",
]

# The starter's socket, set in the stack's Prefect worker's environment (so in every flow
# run's command it starts); a command without it, or whose starter does not answer, starts
# the engine itself.
STARTER_ENV = "DET_TASKS_FLOW_STARTER"
STREAMS = (0, 1, 2)
# The command's answer once the starter names the fork: from then on the flow run is the
# fork's, and the fork runs nothing before it.
GO = {"go": True}
# The checkout (or installation) both sides run from: the starter serves only its own.
PROJECT = Path(__file__).resolve().parents[1]
# What the command passes on to the flow run the starter forked: every signal a worker, a
# shell or a user sends to stop or poke a process (a SIGKILLed command's flow run is
# SIGKILLed by the starter's keeper). The keeper holds them blocked until the flow run is
# ready for them, so one sent while it starts waits instead of being lost.
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 16 * 1024 * 1024
_SUN_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL


def socket_path(root: Path) -> Path:
    """The starter's socket for a stack kept in ``root``: in it where the path fits a Unix
    socket's address, else in a folder of this user's under the temporary directory, named
    by ``root`` (a deep test folder)."""
    inside = root / "run" / "flow-starter.sock"
    if len(os.fsencode(inside)) <= _SUN_PATH_MAX:
        return inside
    digest = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"det-tasks-{os.getuid()}" / f"flow-starter-{digest}.sock"


def process_traits() -> dict[str, Any]:
    """What a process inherits that an interpreter or its imports read once, at start, and a
    fork cannot take from the command: the interpreter's flags and ``PYTHON*`` variables
    (``PYTHONUNBUFFERED`` aside: the flow run's streams are set from it), the umask, the
    resource limits, the scheduling priority and the control groups. The starter takes a
    flow run only from a command whose traits are its own."""
    umask = os.umask(0)
    os.umask(umask)
    limits = {
        name: list(resource.getrlimit(getattr(resource, name)))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }
    try:
        with open("/proc/self/cgroup") as cgroup:
            groups = cgroup.read()
    except OSError:
        groups = ""
    traits = {
        "interpreter flags": list(sys.flags),
        "PYTHON* variables": sorted(
            (k, v)
            for k, v in os.environ.items()
            if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"
        ),
        "umask": umask,
        "resource limits": limits,
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "control groups": groups,
    }
    return json.loads(json.dumps(traits))  # as the other side reads them (lists, not tuples)


def peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(_frame(message))


def send_with_streams(sock: socket.socket, message: dict[str, Any]) -> None:
    """``message`` with this process's standard streams attached. Nothing is sent once the
    frame is out: the starter may already have answered and closed, and an empty send to a
    closed peer fails with EPIPE."""
    frame = _frame(message)
    sent = socket.send_fds(sock, [frame], list(STREAMS))
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _exactly(sock: socket.socket, size: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket mid-message")
        data += chunk
    return bytes(data)


def _decode(sock: socket.socket, head: bytes) -> dict[str, Any]:
    head = _exactly(sock, _HEADER.size, head[: _HEADER.size])
    (size,) = _HEADER.unpack(head)
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes is over the {_MAX_MESSAGE}-byte limit")
    message = json.loads(_exactly(sock, size))
    if not isinstance(message, dict):
        raise ValueError("a message must be a JSON object")
    return message


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None once the other end has closed the socket."""
    head = sock.recv(_HEADER.size)
    if not head:
        return None
    return _decode(sock, head)


def receive_with_streams(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request and the file descriptors that came with it (closed here if it is bad)."""
    head, fds, _flags, _address = socket.recv_fds(sock, _HEADER.size, len(STREAMS))
    try:
        if not head:
            raise EOFError("the socket closed before a request")
        if len(fds) != len(STREAMS):
            raise ValueError(f"a request carries {len(STREAMS)} streams, not {len(fds)}")
        return _decode(sock, head), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
