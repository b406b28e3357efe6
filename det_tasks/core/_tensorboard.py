"""TensorBoard scalars of a Core API script's reports (``TensorboardMode.AUTO``), under the
tags Determined's metric writer uses: ``Determined/<name>`` for training metrics (each of
``batch_metrics`` at its own batch when given), ``Determined/val_<name>`` for validation
ones. Written on the platform only, into the folder it stores with the trial's run."""

from __future__ import annotations

import importlib.util
import logging
import numbers
from pathlib import Path
from typing import Any

__all__ = ["ScalarWriter", "scalar_writer"]

log = logging.getLogger("determined.core")


def scalar_writer(folder: str | None) -> ScalarWriter | None:
    """A writer into the platform's TensorBoard folder; None without one, or without the
    tensorboard package (said once in the log)."""
    if not folder:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        log.warning("Core API metrics are not written to TensorBoard: pip install tensorboard")
        return None
    return ScalarWriter(Path(folder))


class ScalarWriter:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))

    def training(
        self, steps: int, metrics: dict[str, Any], batch_metrics: list[dict[str, Any]] | None
    ) -> None:
        per_batch = batch_metrics or []
        first = steps - len(per_batch)
        for offset, batch in enumerate(per_batch):
            self._scalars(batch, first + offset, "")
        done = {name for batch in per_batch for name in batch}
        self._scalars({k: v for k, v in metrics.items() if k not in done}, steps, "")

    def validation(self, steps: int, metrics: dict[str, Any]) -> None:
        self._scalars(metrics, steps, "val_")

    def close(self) -> None:
        self._writer.close()

    def _scalars(self, metrics: dict[str, Any], step: int, prefix: str) -> None:
        for name, value in metrics.items():
            if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
                value = value.item()
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                tag = name if not prefix or name.startswith("val") else prefix + name
                self._writer.add_scalar(f"Determined/{tag}", float(value), step)
        self._writer.flush()
