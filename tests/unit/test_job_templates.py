"""The Kubernetes GPU base job template renders with Prefect's own templating into a Job
that asks for the GPUs, and declares every placeholder it uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "kubernetes" / "gpu-job-template.json"


def _defaults(template: dict[str, Any]) -> dict[str, Any]:
    return {name: spec.get("default") for name, spec in template["variables"]["properties"].items()}


def test_every_placeholder_is_a_declared_variable() -> None:
    templating = pytest.importorskip("prefect.utilities.templating")
    template = json.loads(TEMPLATE.read_text())
    used = {p.name for p in templating.find_placeholders(template["job_configuration"])}
    declared = set(template["variables"]["properties"])
    assert used, "the template uses no variables"
    assert used <= declared, f"undeclared placeholders: {sorted(used - declared)}"


def test_rendered_job_requests_the_gpus_and_shared_memory() -> None:
    templating = pytest.importorskip("prefect.utilities.templating")
    template = json.loads(TEMPLATE.read_text())
    values = {**_defaults(template), "gpus": 2, "image": "registry.example/det-tasks:1.0"}
    rendered = templating.apply_values(template["job_configuration"], values)
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["image"] == "registry.example/det-tasks:1.0"
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert rendered["job_manifest"]["spec"]["backoffLimit"] == 0  # Prefect retries, not k8s
