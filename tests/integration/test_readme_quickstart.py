"""The README's quickstart, typed into a plain shell against the real stack.

The block marked ``QUICKSTART_MARKER`` in README.md (the docs' quickstart holds the same
block) is fed line by line to one ``bash``, as a terminal feeds what a user types: no virtual
environment activated, an environment emptied by ``env -i`` but for HOME and
``PATH=/usr/bin:/bin``, in a checkout as a fresh clone has it. The only things a user would
not type are the test stack's ports, so ``make up`` finds the session's stack instead of
starting one on the default ports. Where the block shows an example id (``1a2b3c4d``) and a
checkpoint's ``<uuid>``, the test types what the earlier lines printed, as a user does.

Before the block runs, the stack loses the deployment ``det experiment create`` needs and the
record of its registration: ``make up`` itself must register it, as on a fresh clone. After
it, a second ``make up`` must leave the registration alone (nothing changed).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from infra import deployments
from infra.stack import DEPLOYED_STAMP, StackConfig
from tests.integration.helpers import REPO
from tests.integration.test_stack_ports_and_status import stack_env

pytestmark = pytest.mark.slow  # a whole 8-epoch experiment through a Prefect worker

QUICKSTART_MARKER = "<!-- quickstart: tests/integration/test_readme_quickstart.py -->"
SUBMITTED = ("submitted", "flows.experiment.experiment")  # experiment/submitted
LINE_TIMEOUT_S = 600.0


def marked_block(page: Path) -> list[str]:
    """The lines of the ``sh`` block right after the marker on ``page``."""
    text = page.read_text(encoding="utf-8")
    assert text.count(QUICKSTART_MARKER) == 1, f"{page}: mark the quickstart block once"
    after = text.split(QUICKSTART_MARKER, 1)[1]
    block = re.match(r"\s*```sh\n(.*?)^```", after, re.DOTALL | re.MULTILINE)
    assert block, f"{page}: no ```sh block right after {QUICKSTART_MARKER}"
    return [line for line in block.group(1).splitlines() if line.strip()]


class Shell:
    """One ``bash`` that runs the lines it is given in turn, its state (cwd, variables)
    kept between them, as an interactive shell keeps it."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["/bin/bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.put(line)
        self.output.put(None)

    def run(self, line: str, timeout: float = LINE_TIMEOUT_S) -> tuple[int, str]:
        """The line's exit status and output. Its stdin is /dev/null, so a command that
        reads stdin cannot swallow the lines that follow; ``{ }`` keeps it in this shell."""
        assert self.proc.stdin is not None
        done = f"__done_{uuid.uuid4().hex}__"
        self.proc.stdin.write(f"{{ {line}\n}} </dev/null\nprintf '\\n{done} %s\\n' \"$?\"\n")
        self.proc.stdin.flush()
        said: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.output.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"{line!r}: still running after {timeout:.0f} s:\n"
                                     + "".join(said)[-4000:]) from None  # fmt: skip
            if got is None:
                raise AssertionError(f"bash ended during {line!r}:\n" + "".join(said)[-4000:])
            if got.startswith(done):
                return int(got.split()[1]), "".join(said)
            said.append(got)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def fresh_clone(root: Path, stack: StackConfig) -> Path:
    """The checkout as a fresh clone shows it, its ``.stack`` being the session's stack:
    every top-level entry linked, ``examples/`` copied (the quickstart writes ``ckpt/``
    there)."""
    clone = root / "clone"
    clone.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".stack", ".git", "examples"):
            (clone / entry.name).symlink_to(entry)
    shutil.copytree(REPO / "examples", clone / "examples", ignore=shutil.ignore_patterns("ckpt"))
    (clone / ".stack").symlink_to(stack.root)
    return clone


def plain_shell_env(stack: StackConfig) -> dict[str, str]:
    """``env -i`` with HOME (the signing key of this installation lives there, as for the
    stack's worker) and the system PATH; plus the test stack's ports and nothing else."""
    ports = {
        key: value
        for key, value in stack_env(stack).items()
        if key.startswith("DET_TASKS_") and key.endswith(("_PORT", "_GRPC_SHIFT"))
    }
    kept = {k: os.environ[k] for k in ("HOME", "DET_TASKS_HOME") if k in os.environ}
    return {**kept, "PATH": "/usr/bin:/bin", **ports}


def forget_submitted_deployment(stack: StackConfig) -> None:
    """Delete ``experiment/submitted`` from the stack's Prefect server and the record of
    the last registration: what a fresh clone's stack has (nothing registered)."""
    (stack.root / DEPLOYED_STAMP).unlink(missing_ok=True)
    request = urllib.request.Request(
        f"{stack.prefect_api}/deployments/filter",
        data=json.dumps({"deployments": {"name": {"any_": [SUBMITTED[0]]}}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        found = [d for d in json.load(resp) if d["entrypoint"] == SUBMITTED[1]]
    for deployment in found:
        delete = urllib.request.Request(
            f"{stack.prefect_api}/deployments/{deployment['id']}", method="DELETE"
        )
        _with_retries_while_busy(delete)
    assert not deployments.on_server(stack.prefect_api, {SUBMITTED})


def _with_retries_while_busy(request: urllib.request.Request, attempts: int = 6) -> None:
    """Send ``request``, again while a busy Prefect server answers 503 (its SQLite
    database locked by the other suite's writes, CI of stop 56), as Prefect's own client
    does."""
    for attempt in range(attempts):
        try:
            urllib.request.urlopen(request, timeout=30).close()
            return
        except urllib.error.HTTPError as err:
            if err.code != 503 or attempt == attempts - 1:
                raise
            time.sleep(2 * (attempt + 1))


def test_readme_quickstart_runs_as_typed_in_a_plain_shell(stack: StackConfig, tmp_path: Path):
    lines = marked_block(REPO / "README.md")
    assert marked_block(REPO / "docs" / "quickstart.md") == lines, (
        "docs/quickstart.md's stack block differs from the README's: keep them the same"
    )
    example_id = re.search(r"Created experiment (\S+)", "\n".join(lines))
    assert example_id and len(lines) == 5, lines
    forget_submitted_deployment(stack)

    clone = fresh_clone(tmp_path, stack)
    shell = Shell(clone, plain_shell_env(stack))
    typed: dict[str, str] = {}
    said: list[str] = []
    best_error = float("nan")
    started = time.monotonic()
    try:
        for line in lines:
            for shown, real in typed.items():
                line = line.replace(shown, real)
            line_started = time.monotonic()
            rc, out = shell.run(line)
            print(f"{time.monotonic() - line_started:6.1f} s  {line}")
            said.append(out)
            assert rc == 0, f"{line!r} exited {rc}:\n{out[-4000:]}"
            if "Created experiment" in out:
                typed[example_id.group(1)] = re.findall(r"Created experiment (\S+)", out)[-1]
            downloaded = re.search(r"^Checkpoint (\S+): .*=(\S+)$", out, re.MULTILINE)
            if downloaded:
                typed["<uuid>"], best_error = downloaded.group(1), float(downloaded.group(2))
        took = time.monotonic() - started
        # A second make up, on a stack that has the deployments unchanged, skips prefect deploy.
        registered = (stack.root / DEPLOYED_STAMP).stat().st_mtime_ns
        rc, again = shell.run("cd ../.. && make up")
        assert rc == 0, again[-4000:]
        assert (stack.root / DEPLOYED_STAMP).stat().st_mtime_ns == registered, again[-4000:]
    finally:
        shell.close()
    print(f"README quickstart: {took:.1f} s")

    # make up registered what det experiment create runs.
    assert deployments.on_server(stack.prefect_api, {SUBMITTED})
    exp_id = typed[example_id.group(1)]
    assert re.fullmatch(r"[0-9a-f]{8}", exp_id), said[1]
    assert f"Experiment {exp_id} terminated with state COMPLETED" in said[2], said[2]
    assert (clone / "examples" / "mnist" / "ckpt" / typed["<uuid>"]).is_dir()
    assert best_error < 0.1, said[3]  # the tutorial's CNN learned the digits
    # The const config's filters (32, 64), loaded back from the downloaded checkpoint.
    assert "Conv2d(32, 64, kernel_size=(5, 5)" in said[4], said[4][-3000:]
