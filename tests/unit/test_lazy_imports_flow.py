"""Prefect's engine imports the flow's module before it sets the flow run Running, and
``prefect deploy`` imports it for the flow's parameters (issue 53 item 4). flows.experiment
imports only Prefect and light modules at import; torch, MLflow, Dask and boto3 load where
the flow uses them."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "mlflow", "distributed", "dask", "boto3", "botocore", "pandas", "numpy")


def _function_imports() -> list[str]:
    """The modules flows/experiment.py imports inside its functions."""
    tree = ast.parse((ROOT / "flows" / "experiment.py").read_text(encoding="utf-8"))
    return sorted(
        {
            node.module
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef)
            for node in ast.walk(function)
            if isinstance(node, ast.ImportFrom) and node.module
        }
    )


def test_importing_the_flow_loads_no_torch_mlflow_or_dask_until_it_runs():
    """At import: no module of the heavy packages. The modules its functions import are
    the ones that bring them (so the test would notice them moving back to the top)."""
    code = (
        "import importlib, json, sys; heavy, later = map(json.loads, sys.argv[1:]); "
        "import flows.experiment; "
        "at_import = [m for m in sys.modules if m.split('.')[0] in heavy]; "
        "[importlib.import_module(m) for m in later]; "
        "tops = {m.split('.')[0] for m in sys.modules}; "
        "print(json.dumps([at_import, sorted(tops & set(heavy))]))"
    )
    later = _function_imports()
    assert "registry.runs.tracking" in later and "cluster.startup" in later
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(HEAVY), json.dumps(later)],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    at_import, after_use = json.loads(done.stdout.strip().splitlines()[-1])
    assert at_import == []
    assert {"mlflow", "distributed", "boto3"} <= set(after_use)
    # Not even then: the flow checks the user's entrypoint from its source
    # (det_tasks.runner.entrypoint_source), so nothing it runs imports torch.
    assert "torch" not in after_use


def test_the_flows_config_load_and_trial_setup_load_no_torch():
    """What the flow runs up to its first task, besides the user's entrypoint check (which
    imports the user's module, and torch with it): entering the config, the trial chains,
    the tasks and the cluster's step modules, and a trial's spec and step request. None of
    it runs torch code, so none of it imports torch (det_tasks.checkpoints.format,
    det_tasks.runner.held and trial_setup did)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import flows.experiment, flows.chains, flows.tasks, cluster.startup, cluster.steps\n"
        "from det_tasks.config.entered import enter_file\n"
        "from det_tasks.runner.trial_spec import TrialSpec, holdable\n"
        "from flows.tasks import TrialRef\n"
        "entered = enter_file(Path(sys.argv[1]), ['name=lazy'])\n"
        "spec = TrialSpec(sys.argv[1], '.', (), 1, {}, config=entered)\n"
        "ref = TrialRef(spec, 'p', 'e', 'r', holdable=holdable(entered.config) is None)\n"
        "ref.request('train', 0, 8)\n"
        "print('torch' in sys.modules)\n"
    )
    config = ROOT / "tests" / "fixtures" / "flow_model" / "grid.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(config)],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
