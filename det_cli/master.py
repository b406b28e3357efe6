"""What ``-m/--master`` and ``DET_MASTER`` mean here: the platform's Prefect server.

Determined's master is one address that knows everything; here the Prefect server is the
place experiments start and live, so it is the master (``http://HOST:4200`` or its
``.../api`` URL). MLflow, S3 and Dask are found the way every other command finds them: the
environment first, then the stack's ``.stack/env`` (``make up`` writes it), looked for in
``DET_TASKS_STACK_DIR``, the current directory and its parents. Without ``-m``/``DET_MASTER``
the Prefect address comes from the same places.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import shlex
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from det_tasks.errors import DetTasksError

__all__ = ["Master", "find_stack_env", "read_env_file", "resolve_master", "use_master"]

STACK_ENV_FILE = "env"


@dataclasses.dataclass(frozen=True)
class Master:
    """The Prefect API URL ``det`` talks to, and where that address came from."""

    api_url: str
    source: str


def read_env_file(path: Path) -> dict[str, str]:
    """``export KEY=VALUE`` lines (what infra/stack.py writes) as a mapping."""
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export ") :]
        key, sep, value = line.partition("=")
        if sep and key and not key.startswith("#"):
            parts = shlex.split(value) or [""]
            values[key.strip()] = parts[0]
    return values


def find_stack_env(environ: Mapping[str, str], cwd: Path) -> Path | None:
    """``$DET_TASKS_STACK_DIR/env``, else the nearest ``.stack/env`` up from ``cwd``."""
    if environ.get("DET_TASKS_STACK_DIR"):
        candidate = Path(environ["DET_TASKS_STACK_DIR"]) / STACK_ENV_FILE
        return candidate if candidate.is_file() else None
    for folder in (cwd, *cwd.parents):
        candidate = folder / ".stack" / STACK_ENV_FILE
        if candidate.is_file():
            return candidate
    return None


def _api_url(address: str) -> str:
    """``HOST[:PORT]``, ``http://HOST:PORT`` or ``http://HOST:PORT/api`` -> the API URL."""
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = f"http://{address}"
    scheme, _, rest = address.partition("://")
    host = rest.split("/", 1)[0]
    if ":" not in host:
        rest = rest.replace(host, f"{host}:4200", 1)
    url = f"{scheme}://{rest}"
    return url if url.endswith("/api") else f"{url}/api"


def resolve_master(
    flag: str | None, environ: Mapping[str, str], stack_env: Mapping[str, str], stack_path: str
) -> Master:
    """``-m`` beats ``DET_MASTER``, which beats ``PREFECT_API_URL``, then ``.stack/env``."""
    if flag:
        return Master(_api_url(flag), "-m/--master")
    if environ.get("DET_MASTER"):
        return Master(_api_url(environ["DET_MASTER"]), "DET_MASTER")
    if environ.get("PREFECT_API_URL"):
        return Master(environ["PREFECT_API_URL"].rstrip("/"), "PREFECT_API_URL")
    if stack_env.get("PREFECT_API_URL"):
        return Master(stack_env["PREFECT_API_URL"].rstrip("/"), stack_path)
    return Master("http://127.0.0.1:4200/api", "the default address")


def use_master(flag: str | None) -> Master:
    """Fill the environment (Prefect, MLflow, S3 settings) for this process and check the
    Prefect server answers; an unreachable one is a one-line error naming the address."""
    stack = find_stack_env(os.environ, Path.cwd())
    stack_env = read_env_file(stack) if stack else {}
    master = resolve_master(flag, os.environ, stack_env, str(stack) if stack else "")
    for key, value in stack_env.items():
        os.environ.setdefault(key, value)
    os.environ["PREFECT_API_URL"] = master.api_url
    from flows.deployment_runs import reread_prefect_settings

    reread_prefect_settings()
    _check_reachable(master)
    return master


def _check_reachable(master: Master) -> None:
    request = urllib.request.Request(f"{master.api_url}/health")
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        token = base64.b64encode(auth.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5):
            return
    except urllib.error.HTTPError:
        return  # it answered: auth and the rest are the later calls' business
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise DetTasksError(
            f"no platform at {master.api_url} (from {master.source}): {reason}; start the "
            "stack with `make up`, or name its Prefect server with -m/--master or DET_MASTER"
        ) from None
