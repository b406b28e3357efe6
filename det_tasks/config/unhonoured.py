"""Determined config fields that describe its own cluster scheduler, which this project
does not have: accepted (so Determined YAML runs unchanged) but each one warns,
naming the field, what happens instead and what to use; none is silently ignored."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["UnhonouredFieldWarning", "warn_unhonoured"]


class UnhonouredFieldWarning(UserWarning):
    """A config field is accepted for compatibility but does not act as in Determined."""


_RESOURCES = {
    "shm_size": (
        "container shared memory is set by the work pool's job template (Docker "
        "`shm_size` / Kubernetes emptyDir medium: Memory), not by the experiment config"
    ),
}


def warn_unhonoured(raw: dict[str, Any], source: str) -> None:
    """Warn once per unhonoured field the raw config sets (to a non-default value)."""
    resources = _section(raw, "resources")
    for field, why in _RESOURCES.items():
        value = resources.get(field)
        if value is not None:
            _warn(source, f"resources.{field}", value, why)


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def _warn(source: str, path: str, value: Any, why: str) -> None:
    warnings.warn(
        f"{source}: `{path}` = {value!r} is accepted but not honoured: {why}",
        UnhonouredFieldWarning,
        stacklevel=4,
    )
