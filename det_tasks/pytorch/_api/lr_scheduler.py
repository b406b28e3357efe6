"""``LRScheduler``: a torch scheduler plus when the harness steps it."""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = ["LRScheduler"]


class LRScheduler:
    """Wraps a torch LR scheduler so it is checkpointed and stepped at the right time."""

    class StepMode(enum.Enum):
        STEP_EVERY_EPOCH = 1
        STEP_EVERY_BATCH = 2
        MANUAL_STEP = 3
        STEP_EVERY_OPTIMIZER_STEP = 4

    def __init__(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        step_mode: LRScheduler.StepMode,
        frequency: int = 1,
    ) -> None:
        if not isinstance(step_mode, LRScheduler.StepMode):
            raise TypeError(
                f"step_mode must be an LRScheduler.StepMode, got {step_mode!r}; "
                "e.g. LRScheduler.StepMode.STEP_EVERY_EPOCH"
            )
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"LRScheduler frequency must be an int >= 1, got {frequency!r}")
        self._scheduler = scheduler
        self._step_mode = step_mode
        self._frequency = frequency

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self._scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return dict(self._scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Delegate everything else (optimizer, last_epoch, ...) to the torch scheduler.
        if name.startswith("__") or name == "_scheduler":
            raise AttributeError(name)
        return getattr(self._scheduler, name)
