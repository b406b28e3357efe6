"""Mixed precision: autocast for wrapped models, and apex ``opt_level`` mapped onto torch.amp.

apex cannot be installed with current torch, so ``configure_apex_amp`` maps O1/O2 onto
native autocast + GradScaler with a warning, and refuses O3 (pure fp16) with the fix.
Automatic AMP is CUDA-only, as in Determined: on CPU the context trains in fp32 and the
GradScaler is disabled (a pass-through).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

__all__ = ["autocast_dtype", "autocast_module", "make_grad_scaler", "plan_apex_amp"]


def autocast_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA (what apex O1 used), bf16 on CPU (the only fast CPU half type)."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def autocast_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Run ``module.forward`` under ``torch.autocast`` for ``device`` (idempotent)."""
    if getattr(module.forward, "_det_tasks_autocast", False):
        return module
    forward = module.forward
    dtype = autocast_dtype(device)

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device.type, dtype=dtype):
            return forward(*args, **kwargs)

    autocast_forward._det_tasks_autocast = True  # type: ignore[attr-defined]
    module.forward = autocast_forward  # type: ignore[method-assign]
    return module


def make_grad_scaler(
    device: torch.device,
    loss_scale: float | str | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = 2.0**24,
) -> torch.amp.GradScaler:
    """A GradScaler for ``device``; a numeric ``loss_scale`` gives a static scale."""
    scale: float | None = None
    if loss_scale is not None and loss_scale != "dynamic":
        try:
            scale = float(loss_scale)
        except (TypeError, ValueError):
            raise ValueError(
                f"configure_apex_amp loss_scale must be a number or 'dynamic', got {loss_scale!r}"
            ) from None
    if device.type != "cuda":
        return torch.amp.GradScaler(device.type, enabled=False)
    if scale is None:
        return torch.amp.GradScaler(device.type)
    # A static scale never grows or shrinks: growth_interval beyond any run, factors of 1.
    return torch.amp.GradScaler(
        device.type,
        init_scale=scale,
        growth_factor=1.0 + 1e-12,
        backoff_factor=1.0 - 1e-12,
        growth_interval=2**31 - 1,
    )


def plan_apex_amp(opt_level: str | None, enabled: bool | None) -> bool:
    """Decide whether an apex opt_level turns native AMP on (True) or leaves fp32 (False)."""
    if enabled is False or opt_level in (None, "O0"):
        return False
    if opt_level == "O3":
        raise ValueError(
            "configure_apex_amp(opt_level='O3') (pure fp16) is not supported: apex is not "
            "installable with current torch. Use opt_level='O1', or call "
            "context.wrap_scaler(torch.amp.GradScaler()) with torch.autocast yourself"
        )
    if opt_level not in ("O1", "O2"):
        raise ValueError(f"configure_apex_amp opt_level must be O0-O3, got {opt_level!r}")
    warnings.warn(
        f"configure_apex_amp(opt_level={opt_level!r}): apex is not available; using native "
        "torch.autocast + GradScaler instead (fp32 master weights, as apex O1). Prefer "
        "context.experimental.use_amp() or context.wrap_scaler() in new code.",
        UserWarning,
        stacklevel=3,
    )
    return True


def check_apex_options(
    patch_torch_functions: bool | None,
    keep_batchnorm_fp32: bool | str | None,
    master_weights: bool | None,
    num_losses: int | None,
    verbosity: int | None,
) -> None:
    """apex's finer options, against what native autocast does: the ones autocast already
    honours pass silently; the ones it cannot honour warn, naming the argument."""
    unmet = []
    if patch_torch_functions is False:
        unmet.append(
            "patch_torch_functions=False (autocast always casts torch functions, as apex O1)"
        )
    if keep_batchnorm_fp32 in (False, "False", "false"):
        unmet.append("keep_batchnorm_fp32=False (autocast always runs batch norm in fp32)")
    if num_losses is not None and num_losses > 1:
        unmet.append(
            f"num_losses={num_losses} (one GradScaler scales every loss; apex kept one loss "
            "scale per loss)"
        )
    if verbosity is not None and verbosity > 1:
        unmet.append(f"verbosity={verbosity} (no apex log to make more verbose)")
    del master_weights  # True is what native AMP does (fp32 weights); False is refused
    if unmet:
        warnings.warn(
            "configure_apex_amp: native AMP cannot honour " + "; ".join(unmet),
            UserWarning,
            stacklevel=3,
        )
