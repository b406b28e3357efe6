"""``PyTorchCallback``: user code that runs at fixed points of a trial's life.

The harness calls hooks in Determined's order (see ``_loop.py``); under distributed
training every rank runs them, except the chief-only ones noted below.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from det_tasks.errors import TrialError

__all__ = [
    "LegacyHookCaller",
    "PyTorchCallback",
    "adapt_legacy_signatures",
    "overridden",
    "user_callback",
]

log = logging.getLogger(__name__)


class PyTorchCallback:
    """Override any hook; stateful callbacks also override state_dict/load_state_dict."""

    def on_trial_startup(self, first_batch_idx: int, checkpoint_uuid: str | None) -> None:
        """Before training or validation; ``first_batch_idx`` > 0 when resuming."""

    def on_trial_shutdown(self) -> None:
        """After the trial ends, even when it raised."""

    def on_training_start(self) -> None:
        """Once, before the first training batch of this run."""

    def on_training_epoch_start(self, epoch_idx: int) -> None:
        """Before the first batch of every training epoch."""

    def on_training_epoch_end(self, epoch_idx: int) -> None:
        """After the last batch of every training epoch."""

    def on_training_workload_end(
        self, avg_metrics: dict[str, Any], batch_metrics: list[dict[str, Any]]
    ) -> None:
        """At every reporting boundary, with that period's training metrics."""

    def on_validation_start(self) -> None:
        """Before every validation."""

    def on_validation_epoch_start(self) -> None:
        """Before the first validation batch (evaluate_batch trials only)."""

    def on_validation_epoch_end(self, outputs: list[Any]) -> None:
        """After the last validation batch, with every batch's metrics."""

    def on_validation_end(self, metrics: dict[str, Any]) -> None:
        """After every validation, with the reduced metrics (all ranks receive them)."""

    def on_validation_step_start(self) -> None:
        """Deprecated: use on_validation_start."""

    def on_validation_step_end(self, metrics: dict[str, Any]) -> None:
        """Deprecated: use on_validation_end."""

    def on_checkpoint_load_start(self, checkpoint: dict[str, Any]) -> None:
        """Before state is restored, with the loaded ``state_dict.pth`` contents."""

    def on_checkpoint_save_start(self, checkpoint: dict[str, Any]) -> None:
        """Before ``state_dict.pth`` is written; may add entries to ``checkpoint``."""

    def on_checkpoint_end(self, checkpoint_dir: str) -> None:
        """Deprecated alias of on_checkpoint_write_end (chief only)."""

    def on_checkpoint_write_end(self, checkpoint_dir: str) -> None:
        """After every file of a checkpoint is written, before it is published (chief only)."""

    def on_checkpoint_upload_end(self, uuid: str) -> None:
        """After a checkpoint is published to storage (chief only)."""

    def on_before_optimizer_step(self, parameters: Iterator[Any]) -> None:
        """Deprecated: pass clip_grads to context.step_optimizer instead."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""


# How many positional arguments the harness passes to each hook.
_HOOK_ARITY = {
    "on_trial_startup": 2,
    "on_training_epoch_start": 1,
    "on_training_epoch_end": 1,
    "on_training_workload_end": 2,
    "on_validation_epoch_end": 1,
    "on_validation_end": 1,
    "on_validation_step_end": 1,
    "on_checkpoint_load_start": 1,
    "on_checkpoint_save_start": 1,
    "on_checkpoint_end": 1,
    "on_checkpoint_write_end": 1,
    "on_checkpoint_upload_end": 1,
    "on_before_optimizer_step": 1,
}


def adapt_legacy_signatures(callbacks: dict[str, PyTorchCallback]) -> dict[str, Any]:
    """Let hooks written for older Determined take fewer arguments, as Determined does.

    ``on_training_epoch_start(self)`` (before 0.17.8 it had no ``epoch_idx``) and the like
    are called with the leading arguments they accept; a hook that needs more arguments
    than the harness passes is an error naming it. The user's objects are left untouched:
    a callback with such hooks is returned behind a ``LegacyHookCaller`` that adapts the
    calls, every other one as it is.
    """
    adapted: dict[str, Any] = {}
    for name, cb in callbacks.items():
        accepted: dict[str, int] = {}
        for hook, arity in _HOOK_ARITY.items():
            if getattr(type(cb), hook) is getattr(PyTorchCallback, hook):
                continue
            count = _positional_count(getattr(cb, hook), f"callback {name!r}: {hook}", arity)
            if count < arity:
                log.warning(
                    "callback %r: %s takes %d of its %d arguments (an older Determined "
                    "signature); it is called with the first %d. Add the missing parameters",
                    name, hook, count, arity, count,
                )  # fmt: skip
                accepted[hook] = count
        adapted[name] = LegacyHookCaller(cb, accepted) if accepted else cb
    return adapted


class LegacyHookCaller:
    """The harness's handle on a callback with older hook signatures: each such hook is
    called with the leading arguments it accepts; anything else is the callback's own."""

    def __init__(self, callback: PyTorchCallback, accepted: dict[str, int]) -> None:
        self.user_callback = callback
        self._accepted = accepted

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.user_callback, name)
        count = self._accepted.get(name)
        if count is None:
            return attribute
        return functools.partial(_call_with_leading, attribute, count)


def user_callback(callback: Any) -> PyTorchCallback:
    """The user's own callback object behind the harness's handle on it."""
    if isinstance(callback, LegacyHookCaller):
        return callback.user_callback
    return callback  # type: ignore[no-any-return]


def overridden(callback: Any, name: str) -> bool:
    """Whether the callback's class defines ``name`` itself (not PyTorchCallback's no-op)."""
    return getattr(type(user_callback(callback)), name) is not getattr(PyTorchCallback, name)


def _positional_count(method: Any, where: str, arity: int) -> int:
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return arity
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return arity
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > arity:
        raise TrialError(
            f"{where} requires {len(required)} arguments but the harness passes {arity}: "
            f"({', '.join(p.name for p in required)}); see PyTorchCallback for its signature"
        )
    return min(len(positional), arity)


def _call_with_leading(method: Any, count: int, *args: Any) -> Any:
    return method(*args[:count])
