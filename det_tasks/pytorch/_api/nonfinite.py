"""What happens when a training loss is NaN or infinite.

``optimizations.nonfinite_loss`` (a det_tasks extension of Determined's config):

- ``warn`` (default, Determined's behaviour): training goes on. The first such batch is
  named in a warning, and a report whose window had any counts them in the platform's own
  metric ``det_tasks/nonfinite_loss_batches`` (``report_metrics`` of the sink, so MLflow
  shows it beside the training metrics). It never joins the training metrics the user's
  code sees (callbacks, the Trainer's results): Determined reports no such key. The check
  is deferred to the reporting boundary, so the training step never waits for the device.
- ``error``: the trial stops with an error naming the first such batch. On CPU that is the
  batch itself; on a GPU the check is deferred to the next reporting, validation or
  checkpoint boundary (a per-step host sync would stall the launch pipeline), still before
  any checkpoint or metric of the poisoned weights is written.
- ``skip``: the batch contributes no gradient, and an optimizer step whose every batch
  was skipped does not happen (momentum would otherwise still move the weights). Each
  skip is counted and warned about. Single-process only: ranks would disagree on steps.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from det_tasks.errors import ConfigError, TrialError

__all__ = ["GROUP", "METRIC", "POLICIES", "NonFiniteGuard", "report_count"]

POLICIES = ("warn", "error", "skip")
GROUP = "det_tasks"  # the platform's metric group: its keys read det_tasks/<name>
METRIC = "nonfinite_loss_batches"
log = logging.getLogger(__name__)


class NonFiniteGuard:
    def __init__(self, policy: str, device: torch.device, world_size: int) -> None:
        if policy not in POLICIES:
            raise ConfigError(
                f"optimizations.nonfinite_loss = {policy!r} is invalid: use one of {POLICIES}"
            )
        if policy == "skip" and world_size > 1:
            raise ConfigError(
                "optimizations.nonfinite_loss = 'skip' is not supported with "
                f"{world_size} workers (ranks would disagree on which steps happen); use "
                "'warn' or 'error', or slots_per_trial: 1"
            )
        self.policy = policy
        # On the host a loss is checked as it comes (one item(), no sync to avoid); on a GPU
        # each batch keeps (index, detached loss) for one batched check at the boundary, so
        # the step launches no kernel and never waits for the device.
        self._on_host = device.type == "cpu"
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._found: list[int] = []  # non-finite batches seen on the host since the check
        self._window_has_grads = False
        self._warned = False
        self.skipped_batches = 0
        self.nonfinite_batches = 0

    def admit(self, loss: torch.Tensor, batch_idx: int) -> bool:
        """Whether ``loss.backward()`` should run for this batch."""
        if self.policy == "skip":
            if not _finite_now(loss):
                self.skipped_batches += 1
                log.warning(
                    "batch %d: non-finite loss %s, skipped (%d so far; "
                    "optimizations.nonfinite_loss = skip)",
                    batch_idx, loss.detach().flatten()[:1].tolist(), self.skipped_batches,
                )  # fmt: skip
                return False
            self._window_has_grads = True
            return True
        if self._on_host:
            if not _finite_now(loss):
                if self.policy == "error":
                    raise self._error(batch_idx)
                self._found.append(batch_idx)
            return True
        self._pending.append((batch_idx, loss.detach()))  # a view: no kernel, no sync
        return True

    def allow_step(self) -> bool:
        """At an optimizer-step boundary: False when every batch of the window was skipped."""
        if self.policy != "skip":
            return True
        allowed, self._window_has_grads = self._window_has_grads, False
        return allowed

    def check(self) -> int:
        """At a reporting/checkpoint boundary: the window's count of non-finite batches
        (``warn``), or raise for the first one (``error``)."""
        found, self._found = self._found, []
        if self._pending:
            pending, self._pending = self._pending, []
            finite = _all_finite([loss for _, loss in pending]).cpu().tolist()
            found += [index for (index, _), ok in zip(pending, finite) if not ok]
        if not found:
            return 0
        first = found[0]
        if self.policy == "error":
            raise self._error(first)
        count = len(found)
        self.nonfinite_batches += count
        if not self._warned:
            self._warned = True
            log.warning(
                "training loss is NaN or infinite at batch %d; training goes on, as in "
                "Determined. Non-finite batches are counted in the metric %r. Set "
                "optimizations.nonfinite_loss: error to stop, or skip to drop such batches",
                first, f"{GROUP}/{METRIC}",
            )  # fmt: skip
        return count

    @staticmethod
    def _error(batch_idx: int) -> TrialError:
        return TrialError(
            f"training loss is NaN or infinite at batch {batch_idx}: stopping instead of "
            "training on (optimizations.nonfinite_loss: error). Lower the learning rate, clip "
            "gradients (step_optimizer(clip_grads=...)), check the data, or set "
            "optimizations.nonfinite_loss: skip"
        )


def report_count(sink: Any, steps_completed: int, count: int) -> None:
    """The window's count of non-finite batches, when there were any, as the platform's
    metric: through the sink's optional ``report_metrics``, apart from the training
    metrics (a sink without it has the warning only)."""
    report = getattr(sink, "report_metrics", None)
    if count and report is not None:
        report(GROUP, steps_completed, {METRIC: count})


def _finite_now(loss: torch.Tensor) -> bool:
    """Checked on the host now: one ``item()`` for a scalar loss instead of three ops."""
    if loss.numel() == 1:
        return math.isfinite(loss.item())
    return bool(torch.isfinite(loss.detach()).all())


def _all_finite(losses: list[torch.Tensor]) -> torch.Tensor:
    """One bool per loss; scalars (the usual case) are checked with a single stack."""
    if all(loss.numel() == 1 for loss in losses):
        return torch.isfinite(torch.stack([loss.reshape(()) for loss in losses]))  # promotes
    return torch.stack([torch.isfinite(loss).all() for loss in losses])
