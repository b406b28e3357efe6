"""Restoring a trial from a checkpoint: find it (a uuid in the store, a directory or a URI)
and put every piece of saved state back into what the trial wrapped, refusing a checkpoint
whose shape does not fit instead of loading part of it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.references import open_checkpoint_uri, scheme_of
from det_tasks.checkpoints.store import CheckpointStore
from det_tasks.errors import CheckpointError
from det_tasks.pytorch._api.callback import PyTorchCallback, overridden
from det_tasks.pytorch._api.context import PyTorchTrialContext

__all__ = ["load_model_weights", "load_state", "open_checkpoint", "overridden", "weights_mismatch"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def open_checkpoint(store: CheckpointStore, reference: str) -> Iterator[Path]:
    """A checkpoint by uuid in ``store``, or by directory path."""
    if os.path.isdir(reference):
        yield Path(reference)
        return
    if scheme_of(reference) is not None:
        with open_checkpoint_uri(reference) as path:
            yield path
        return
    with store.restore(reference) as path:
        yield path


def load_state(
    context: PyTorchTrialContext, callbacks: dict[str, PyTorchCallback], state: dict[str, Any]
) -> None:
    """Restore models, optimizers, schedulers, scaler, RNG and callbacks from a state dict."""
    for cb in callbacks.values():
        cb.on_checkpoint_load_start(state)
    models = state.get("models_state_dict")
    if models is None and "model_state_dict" in state:
        models = [state["model_state_dict"]]
    if models is None or len(models) != len(context.models):
        found = "none" if models is None else len(models)
        raise CheckpointError(
            f"the checkpoint holds {found} model state dicts but the trial wrapped "
            f"{len(context.models)} models; was it written by a different trial class?"
        )
    for model, sd in zip(context.models, models):
        load_model_weights(model, sd)
    optimizers = state.get("optimizers_state_dict")
    if optimizers is None and "optimizer_state_dict" in state:
        optimizers = [state["optimizer_state_dict"]]
    for opt, sd in zip(context.optimizers, _matching("optimizer", optimizers, context.optimizers)):
        opt.load_state_dict(sd)
    schedulers = state.get("lr_schedulers_state_dict")
    if schedulers is None and "lr_scheduler" in state:  # Determined's pre-0.13 single key
        schedulers = [state["lr_scheduler"]]
    for sched, sd in zip(
        context.lr_schedulers, _matching("LR scheduler", schedulers, context.lr_schedulers)
    ):
        sched.load_state_dict(sd)
    if context._scaler is not None and "scaler_state_dict" in state:
        context._scaler.load_state_dict(state["scaler_state_dict"])
    if "rng_state" in state:
        ckpt.restore_rng_state(state["rng_state"], context.device)
    saved = state.get("callbacks") or {}
    for name, cb in callbacks.items():
        if name in saved:
            cb.load_state_dict(saved[name])
        elif overridden(cb, "load_state_dict"):
            log.warning("callback %r has no saved state in the checkpoint; starting fresh", name)


def _matching(kind: str, saved: list[Any] | None, wrapped: list[Any]) -> list[Any]:
    """The saved state dicts, refusing a count that differs from what the trial wrapped
    (zipping would silently drop the extras or leave some fresh)."""
    if saved is None:
        return []
    if len(saved) != len(wrapped):
        raise CheckpointError(
            f"the checkpoint holds {len(saved)} {kind} state dicts but the trial wrapped "
            f"{len(wrapped)} {kind}s; resume with the trial code and hyperparameters that "
            "wrote it, or start from scratch"
        )
    return list(saved)


def load_model_weights(model: torch.nn.Module, sd: dict[str, Any]) -> None:
    """Load a state dict into a model, DDP-wrapped or not, with or without the "module."
    prefix; a shape that does not fit is a CheckpointError naming the model."""
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    target: torch.nn.Module = model.module if is_ddp else model  # type: ignore[assignment]
    sd = dict(sd)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    try:
        target.load_state_dict(sd)
    except RuntimeError as err:
        raise CheckpointError(weights_mismatch(type(target).__name__, str(err))) from None


# A wide model's mismatch lists every tensor; the first ones say what changed.
_MISMATCH_LINES = 20


def weights_mismatch(model: str, torch_message: str) -> str:
    """What torch's load_state_dict said, every line whole (each mismatched tensor with
    both shapes, missing and unexpected keys), under one line naming the model; the cause
    (changed code, or hyperparameters that shape the model) is for the caller that knows
    it to say."""
    lines = [line.strip() for line in torch_message.splitlines()[1:] if line.strip()]
    shown = [f"  {line}" for line in lines[:_MISMATCH_LINES]]
    if len(lines) > _MISMATCH_LINES:
        shown.append(f"  ... and {len(lines) - _MISMATCH_LINES} more")
    if not shown:  # not torch's usual form: its message as it is
        shown = [f"  {torch_message.strip()}"]
    return "\n".join(
        [
            f"the checkpoint's model weights do not fit {model}: the model the trial builds "
            "now has other tensors or shapes than the one that wrote the checkpoint:",
            *shown,
        ]
    )
