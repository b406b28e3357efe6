"""det_tasks.first_use: a shared database is created by exactly one of several processes
started together, and a creator that dies holding the lock blocks nobody."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

from det_tasks.first_use import create_once, exclusive


def _create_slowly(database: Path, log: Path) -> None:
    def create() -> None:
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that every other process arrives meanwhile
        database.write_text("schema")

    create_once(database, create)
    # Whoever returns must find the database complete.
    assert database.read_text() == "schema"


def test_four_processes_started_together_create_the_database_once(tmp_path: Path):
    database, log = tmp_path / "store.db", tmp_path / "creators.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_create_slowly, args=(database, log)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    assert len(log.read_text().splitlines()) == 1
    assert (tmp_path / "store.db.ready").exists()


def test_a_later_call_does_not_create_again(tmp_path: Path):
    database = tmp_path / "store.db"
    calls: list[int] = []
    create_once(database, lambda: calls.append(1))
    create_once(database, lambda: calls.append(2))
    assert calls == [1]


def _hold_forever(lock: Path, held: multiprocessing.synchronize.Event) -> None:
    with exclusive(lock):
        held.set()
        time.sleep(600)


def test_a_creator_killed_holding_the_lock_blocks_nobody(tmp_path: Path):
    database = tmp_path / "store.db"
    ctx = multiprocessing.get_context("fork")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(tmp_path / "store.db.lock", held))
    holder.start()
    assert held.wait(10)
    os.kill(holder.pid or 0, signal.SIGKILL)
    holder.join(10)
    calls: list[int] = []
    create_once(database, lambda: calls.append(1))
    assert calls == [1]
