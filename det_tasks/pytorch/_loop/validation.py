"""One validation pass: evaluate_batch (sharded, reduced) or evaluate_full_dataset (chief).

Metrics stay tensors until the pass ends, then are read in one transfer; reduction goes
per-slot then cross-slot, as Determined's does. Callbacks see Determined's types (numpy
arrays and scalars: a float32 loss averages in float32 to an ``np.float32``); what the pass
returns (to sinks, results, checkpoint metadata) is the same numbers as Python values.
"""

from __future__ import annotations

from typing import Any

import torch

from det_tasks.errors import TrialError
from det_tasks.pytorch._api.callback import PyTorchCallback, overridden
from det_tasks.pytorch._api.context import PyTorchTrialContext
from det_tasks.pytorch._api.reducer import reduce_batch_metrics, to_python
from det_tasks.pytorch._api.trial import (
    evaluate_batch_defined,
    evaluate_batch_takes_index,
    evaluate_full_dataset_defined,
)
from det_tasks.pytorch._data.feeder import iterate_batches
from det_tasks.pytorch._data.loader import DataLoader
from det_tasks.pytorch._loop.metrics import (
    as_numpy,
    check_metrics,
    detach_metrics,
    materialize,
    numpy_batches,
)

__all__ = ["validate"]


def validate(
    trial: Any,
    context: PyTorchTrialContext,
    loader: Any,
    callbacks: dict[str, PyTorchCallback],
    test_mode: bool = False,
) -> dict[str, Any]:
    """Run validation and every validation callback; returns the reduced metrics as Python
    values (callbacks saw them as Determined gives them, and may have added some)."""
    by_batch = evaluate_batch_defined(trial)
    by_dataset = evaluate_full_dataset_defined(trial)
    if by_batch == by_dataset:
        raise TrialError(
            f"{type(trial).__name__} must override exactly one of evaluate_batch() and "
            f"evaluate_full_dataset() (it overrides {'both' if by_batch else 'neither'})"
        )
    context.experimental.reset_reducers()
    for model in context.models:
        model.eval()
    try:
        with torch.no_grad():
            for cb in callbacks.values():
                if overridden(cb, "on_validation_step_start"):
                    cb.on_validation_step_start()
                cb.on_validation_start()
            if by_batch:
                metrics = _by_batch(trial, context, loader, callbacks, test_mode)
            else:
                metrics = _full_dataset(trial, context, loader)
            metrics.update(context.experimental.reduce_metrics(for_training=False))
            for cb in callbacks.values():
                if overridden(cb, "on_validation_step_end"):
                    cb.on_validation_step_end(metrics)
                cb.on_validation_end(metrics)
    finally:
        for model in context.models:
            model.train()
    return {key: to_python(value) for key, value in metrics.items()}


def _by_batch(
    trial: Any,
    context: PyTorchTrialContext,
    loader: Any,
    callbacks: dict[str, PyTorchCallback],
    test_mode: bool,
) -> dict[str, Any]:
    dist = context.distributed
    with_index = evaluate_batch_takes_index(trial)
    for cb in callbacks.values():
        cb.on_validation_epoch_start()
    batches = iterate_batches(
        loader, seed=context.get_trial_seed(), rank=dist.rank, size=dist.size, repeat=False
    )
    outputs: list[dict[str, Any]] = []
    keys: list[str] | None = None
    for idx, batch in enumerate(batches):
        if context.experimental._auto_to_device:
            batch = context.to_device(batch)
        if with_index:
            result = trial.evaluate_batch(batch=batch, batch_idx=idx)
        else:
            result = trial.evaluate_batch(batch=batch)
        result = check_metrics(result, "evaluate_batch")
        if keys is None:
            keys = list(result)
        elif set(keys) != set(result):
            raise TrialError(
                "evaluate_batch() must return the same metric names for every batch: "
                f"batch 0 gave {sorted(keys)}, batch {idx} gave {sorted(result)}"
            )
        outputs.append(detach_metrics(result))
        if test_mode:
            break
    plain = numpy_batches(outputs, materialize(outputs))
    for cb in callbacks.values():
        cb.on_validation_epoch_end(plain)
    # With fewer batches than ranks some ranks see none; only an empty loader is a mistake.
    everyone = dist.allgather(plain)
    if not any(everyone) and isinstance(loader, DataLoader | torch.utils.data.DataLoader):
        raise TrialError("build_validation_data_loader() returned a loader with no batches")
    return reduce_batch_metrics(trial.evaluation_reducer(), everyone)


def _full_dataset(trial: Any, context: PyTorchTrialContext, loader: Any) -> dict[str, Any]:
    dist = context.distributed
    metrics: dict[str, Any] | None = None
    if dist.is_chief:
        torch_loader = (
            loader.get_data_loader(context.get_trial_seed(), private_generator=False)
            if isinstance(loader, DataLoader)
            else loader
        )
        result = trial.evaluate_full_dataset(data_loader=torch_loader)
        if not isinstance(result, dict):
            raise TrialError(
                f"evaluate_full_dataset() must return a dict of metrics, got "
                f"{type(result).__name__}"
            )
        metrics = {k: as_numpy(v) for k, v in result.items()}
    return dict(dist.broadcast(metrics))
