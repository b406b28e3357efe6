"""``optimizations.tensor_fusion_*``: Determined's Horovod tuning knobs, as the environment
variables Horovod reads when ``hvd.init()`` runs."""

from __future__ import annotations

from typing import Any

__all__ = ["horovod_tuning_env"]


def horovod_tuning_env(optimizations: dict[str, Any]) -> dict[str, str]:
    """``tensor_fusion_threshold`` (MB, as in Determined) -> ``HOROVOD_FUSION_THRESHOLD``
    (bytes); ``tensor_fusion_cycle_time`` (ms) -> ``HOROVOD_CYCLE_TIME``;
    ``auto_tune_tensor_fusion`` -> ``HOROVOD_AUTOTUNE``."""
    env: dict[str, str] = {}
    threshold = optimizations.get("tensor_fusion_threshold")
    if threshold is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(threshold) * 1024 * 1024)
    cycle = optimizations.get("tensor_fusion_cycle_time")
    if cycle is not None:
        env["HOROVOD_CYCLE_TIME"] = str(cycle)
    if optimizations.get("auto_tune_tensor_fusion"):
        env["HOROVOD_AUTOTUNE"] = "1"
    return env
