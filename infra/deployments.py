"""Whether a Prefect server already holds this checkout's deployments (``prefect.yaml``).

``make up`` registers the deployments so that ``det experiment create`` finds
``experiment/submitted`` on a fresh stack. ``prefect deploy`` imports every flow to read its
parameters (10-20 s on 2 cores), so a ``make up`` on a stack that has them, registered from the
same ``prefect.yaml`` and flow signatures, skips it. The answer comes from the server itself (a
wiped database is noticed) and from a fingerprint kept beside the stack's state (an edited
``prefect.yaml`` or flow signature is noticed). ``make deploy`` always registers.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import yaml

__all__ = ["fingerprint", "is_current", "on_server", "wanted"]

PREFECT_FILE = "prefect.yaml"


def wanted(project_dir: Path) -> set[tuple[str, str]]:
    """``(deployment name, entrypoint)`` for each deployment in ``prefect.yaml``: two flows
    may each have a deployment of the same name (``submitted``)."""
    doc = yaml.safe_load((project_dir / PREFECT_FILE).read_text(encoding="utf-8"))
    return {(d["name"], d["entrypoint"]) for d in doc.get("deployments") or []}


def fingerprint(project_dir: Path) -> str:
    """A hash of ``prefect.yaml`` and of each entrypoint's signature, decorator and docstring,
    read from its source without importing it: what the registered deployment holds (its
    parameter schema). A change to a flow's body needs no registration (a deployment names a
    module path, which workers import when they run it) and does not change this."""
    digest = hashlib.sha256((project_dir / PREFECT_FILE).read_bytes())
    for entrypoint in sorted({entry for _, entry in wanted(project_dir)}):
        digest.update(entrypoint.encode() + b"\0" + _signature(project_dir, entrypoint) + b"\0")
    return digest.hexdigest()


def _signature(project_dir: Path, entrypoint: str) -> bytes:
    """What of the entrypoint's function shapes its deployment; its module's whole source
    when the function is not found there (``prefect deploy`` then says what is wrong)."""
    module, _, name = entrypoint.rpartition(".")
    source = project_dir / (module.replace(".", "/") + ".py")
    if not source.is_file():
        return b""
    text = source.read_bytes()
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return text
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            parts = [node.args, node.returns, *node.decorator_list]
            shape = [ast.dump(part) for part in parts if part is not None]
            return repr((shape, ast.get_docstring(node))).encode()
    return text


def on_server(api_url: str, deployments: set[tuple[str, str]], auth_string: str = "") -> bool:
    """Whether the Prefect server at ``api_url`` has every one of ``deployments``; False when
    it cannot be asked (the caller then registers, and that reports any real fault)."""
    body = {"deployments": {"name": {"any_": sorted({name for name, _ in deployments})}}}
    request = urllib.request.Request(
        f"{api_url.rstrip('/')}/deployments/filter",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    if auth_string:
        token = base64.b64encode(auth_string.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            found = {(d["name"], d["entrypoint"]) for d in json.load(resp)}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return deployments <= found


def is_current(stamp: Path, project_dir: Path, api_url: str, auth_string: str = "") -> bool:
    """True when ``stamp`` (written after the last registration) holds this checkout's
    fingerprint and the server still has every deployment."""
    try:
        recorded = stamp.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return False
    return recorded == fingerprint(project_dir) and on_server(
        api_url, wanted(project_dir), auth_string
    )
