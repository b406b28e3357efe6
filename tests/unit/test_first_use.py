"""registry.servers.shared_database: a shared database is created by exactly one of several
processes started together, and a creator that dies holding the lock blocks nobody."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from registry.servers.shared_database import create_once

# Each creator is a fresh interpreter, as two `python -m flows.experiment` started together
# are (a child forked from pytest inherits whatever threads and locks earlier tests left).
_CREATOR = """
import os, sys, time
from pathlib import Path
from registry.servers.shared_database import create_once

database, log = Path(sys.argv[1]), Path(sys.argv[2])

def create():
    with open(log, "a") as handle:
        handle.write(f"{os.getpid()}\\n")
    time.sleep(2)  # long enough that every other process arrives meanwhile
    database.write_text("schema")

create_once(database, create)
# Whoever returns must find the database complete.
assert database.read_text() == "schema"
"""


def test_four_processes_started_together_create_the_database_once(tmp_path: Path):
    database, log = tmp_path / "store.db", tmp_path / "creators.log"
    argv = [sys.executable, "-c", _CREATOR, str(database), str(log)]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(4)
    ]
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], outputs
    assert len(log.read_text().splitlines()) == 1
    assert (tmp_path / "store.db.ready").exists()


def test_a_later_call_does_not_create_again(tmp_path: Path):
    database = tmp_path / "store.db"
    calls: list[int] = []
    create_once(database, lambda: calls.append(1))
    create_once(database, lambda: calls.append(2))
    assert calls == [1]


_HOLDER = """
import sys, time
from pathlib import Path
from registry.servers.shared_database import exclusive

with exclusive(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_creator_killed_holding_the_lock_blocks_nobody(tmp_path: Path):
    database = tmp_path / "store.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "store.db.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    calls: list[int] = []
    create_once(database, lambda: calls.append(1))
    assert calls == [1]
