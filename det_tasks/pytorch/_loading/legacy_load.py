"""Loading a checkpoint of a trial that defines ``build_model()``: the bare model.

Determined 0.38's ``load_trial_from_checkpoint_path`` returns, for such a trial (the
pre-0.13 interface), the ``torch.nn.Module`` that ``build_model()`` builds with the saved
weights, not the trial; code written against it calls the result directly. The state is
read as every other checkpoint is (weights_only unless the caller says otherwise).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from det_tasks.errors import CheckpointError

__all__ = ["bare_model_of"]


def bare_model_of(
    trial: Any, state: dict[str, Any], device: torch.device
) -> torch.nn.Module | None:
    """The trial's ``build_model()`` with the checkpoint's first model weights, in eval mode
    on ``device``; None when the trial has no ``build_model()`` callable without arguments
    (a helper that needs some is the trial's own business: the trial is returned)."""
    build = getattr(trial, "build_model", None)
    if not callable(build) or not _callable_without_arguments(build):
        return None
    model = build()
    name = type(trial).__name__
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(
            f"{name}.build_model() must return a torch.nn.Module to load this checkpoint, got "
            f"{type(model).__name__}"
        )
    from det_tasks.pytorch._loop.restore import load_model_weights

    load_model_weights(model.to(device), _first_model_weights(state, name))
    return model.eval()


def _callable_without_arguments(fn: Any) -> bool:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): Determined calls it as is
        return True
    return True


def _first_model_weights(state: dict[str, Any], trial_name: str) -> dict[str, Any]:
    """``model_state_dict`` (0.13's single key) or the first of ``models_state_dict``."""
    if "model_state_dict" in state:
        return dict(state["model_state_dict"])
    models = state.get("models_state_dict")
    if not models:
        raise CheckpointError(
            f"the checkpoint holds no model weights (neither model_state_dict nor "
            f"models_state_dict) for {trial_name}.build_model(); was it written by a "
            "PyTorchTrial?"
        )
    return dict(models[0])
