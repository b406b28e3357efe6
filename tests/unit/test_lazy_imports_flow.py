"""Prefect's engine imports the flow's module before it sets the flow run Running (issue 53
item 4: create to the first batch). flows.experiment imports only Prefect and light modules
at import; torch, MLflow, Dask and boto3 load where they are used, and in a worker's
flow-run process on a thread from import on (flows.prefetch), which the flow waits for
before it uses them."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows.prefetch import FLOW_RUN_ENV, Prefetch

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "mlflow", "distributed", "dask", "boto3", "botocore", "pandas", "numpy")


def _run(code: str, modules: list[str] | None = None, **env: str) -> dict:
    """``code`` in a fresh interpreter (this checkout importable), given ``HEAVY`` and
    ``MODULES``; its last line of output, JSON."""
    environ = {k: v for k, v in os.environ.items() if k != FLOW_RUN_ENV}
    environ.update(PYTHONPATH=str(ROOT), **env)
    given = "import json, sys; HEAVY, MODULES = map(json.loads, sys.argv[1:])\n"
    argv = [sys.executable, "-c", given + textwrap.dedent(code), json.dumps(HEAVY),
            json.dumps(modules or [])]  # fmt: skip
    done = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _function_imports() -> list[str]:
    """The modules flows/experiment.py imports inside its functions."""
    tree = ast.parse((ROOT / "flows" / "experiment.py").read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            found += [
                n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom) and n.module
            ]
    return sorted(set(found))


def test_importing_the_flow_loads_no_torch_mlflow_or_dask():
    loaded = _run("""
        import flows.experiment as flow
        heavy = [m for m in sys.modules if m.split(".")[0] in HEAVY]
        print(json.dumps({"heavy": heavy, "started": flow._PREFETCH.started}))
    """)  # fmt: skip
    assert loaded == {"heavy": [], "started": False}


def test_a_worker_flow_run_prefetches_every_heavy_module_the_flow_imports():
    """With the engine's flow-run id set, the prefetch starts at import; once it is done,
    the flow's own imports (every one inside its functions) load no torch, MLflow, Dask or
    boto3 module it had not loaded: the prefetch list is complete."""
    modules = _function_imports()
    assert "registry.tracking" in modules and "cluster.startup" in modules
    loaded = _run("""
        import importlib
        import flows.experiment as flow
        started = flow._PREFETCH.started
        flow._PREFETCH.wait()
        before = set(sys.modules)
        for name in MODULES:
            importlib.import_module(name)
        new = [m for m in set(sys.modules) - before if m.split(".")[0] in HEAVY]
        print(json.dumps({"started": started, "new": sorted(new),
                          "torch": "torch" in sys.modules, "mlflow": "mlflow" in sys.modules,
                          "distributed": "distributed" in sys.modules}))
    """, modules, **{FLOW_RUN_ENV: "1a2b3c4d-0000-4000-8000-000000000001"})  # fmt: skip
    assert loaded == {"started": True, "new": [], "torch": True, "mlflow": True,
                      "distributed": True}  # fmt: skip


def test_the_flow_waits_for_the_prefetch_before_anything_else():
    tree = ast.parse((ROOT / "flows" / "experiment.py").read_text(encoding="utf-8"))
    flow = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "experiment"
    )
    first = flow.body[1] if isinstance(flow.body[0].value, ast.Constant) else flow.body[0]  # type: ignore[attr-defined]
    assert ast.unparse(first) == "_PREFETCH.wait()"


def test_prefetch_imports_in_order_and_leaves_a_failure_to_the_flow(tmp_path, monkeypatch):
    (tmp_path / "hc_first.py").write_text("import hc_log; hc_log.seen.append('first')\n")
    (tmp_path / "hc_broken.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp_path / "hc_never.py").write_text("import hc_log; hc_log.seen.append('never')\n")
    (tmp_path / "hc_log.py").write_text("seen = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(FLOW_RUN_ENV, raising=False)
    assert not Prefetch(["hc_first"]).started  # not a worker's flow run: nothing starts
    prefetch = Prefetch(["hc_first", "hc_broken", "hc_never"], start=True)
    prefetch.wait()
    import hc_log

    assert hc_log.seen == ["first"]
    with pytest.raises(ImportError, match="broken on purpose"):
        import hc_broken  # noqa: F401
