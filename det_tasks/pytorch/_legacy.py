"""Helpers from Determined's pre-0.13 PyTorch interface that old trials still import."""

from __future__ import annotations

import torch

__all__ = ["reset_parameters"]


def reset_parameters(model: torch.nn.Module) -> None:
    """Re-initialise every submodule that knows how (``determined.pytorch.reset_parameters``)."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if module is not model and callable(reset):
            reset()
