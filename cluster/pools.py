"""Resource pools: a worker belongs to the pool its Dask resource ``pool-<name>`` names (the
stack's workers: ``pool-default``); a worker naming none is in ``default``. No Dask import:
``det`` checks a config's pool with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_POOL", "POOL_ENV", "POOL_RESOURCE_PREFIX", "pool_resource_arg", "worker_pool"]

DEFAULT_POOL = "default"  # Determined's default pool's name
POOL_RESOURCE_PREFIX = "pool-"
POOL_ENV = "DET_TASKS_RESOURCE_POOL"  # the pool the stack's and warm home's workers join


def worker_pool(resources: Mapping[str, Any]) -> str:
    """The pool a worker with these Dask resources belongs to."""
    for name in resources:
        if name.startswith(POOL_RESOURCE_PREFIX):
            return name[len(POOL_RESOURCE_PREFIX) :]
    return DEFAULT_POOL


def pool_resource_arg(pool: str) -> str:
    """``dask worker --resources`` text that puts a worker in ``pool``."""
    return f"{POOL_RESOURCE_PREFIX}{pool}=1"
