"""System metrics on trial runs: CPU, memory, disk, network, and GPU utilisation and memory
where pynvml (``nvidia-ml-py``, in the platform extra) finds an NVIDIA GPU, sampled by
MLflow's own monitors as ``system/*`` metrics.

Two changes to MLflow's sampler loop, for trials whose steps last seconds: a last sample
is taken and logged when the trial's services end, so even a run shorter than the
interval has its point; and the loop does not ask the server every sample whether the run
still runs (a ``get_run`` per trial per sample), since the run's owner always stops the
sampler before it ends the run.

A sample that cannot be logged (MLflow or its store down for a while) never fails the trial:
it is dropped, the next sample is tried as usual, and only the first failure of a run is
reported (one warning, not one per interval). A sampler that cannot start is one warning too.
"""

from __future__ import annotations

import logging
from typing import Any

from registry.servers.settings import RegistrySettings

__all__ = ["TrialSystemMetrics", "start_system_metrics"]

_logger = logging.getLogger(__name__)


def start_system_metrics(settings: RegistrySettings, run_id: str) -> TrialSystemMetrics | None:
    """Sample the trial run's system metrics every ``DET_TASKS_SYSTEM_METRICS_INTERVAL``
    seconds (0: off) and once more when ``finish`` is called."""
    if settings.system_metrics_interval <= 0:
        return None
    try:
        sampler = TrialSystemMetrics(
            run_id, settings.system_metrics_interval, tracking_uri=settings.tracking_uri
        )
        sampler.start()
    except Exception as err:  # auxiliary: the trial trains without it
        _logger.warning("system metrics of run %s are off: %s: %s", run_id, type(err).__name__, err)
        return None
    return sampler


def _monitor_class() -> Any:
    # Imported when a sampler starts: MLflow's system-metrics package pulls in psutil and
    # pynvml, which a run with sampling off never needs.
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class _Monitor(SystemMetricsMonitor):  # type: ignore[misc]
        failures = 0

        def monitor(self) -> None:
            while not self._shutdown_event.wait(self.sampling_interval):
                self.sample()  # a failed one is dropped; the next is tried as usual

        def sample(self) -> bool:
            """Take one sample and log it with whatever was sampled since the last log."""
            try:
                self.collect_metrics()
                self.publish_metrics(self.aggregate_metrics())
            except Exception as err:  # a sampler must never fail the trial
                self.note_failure(err)
                return False
            return True

        def note_failure(self, err: Exception) -> None:
            """One warning per run: the first failure, and that later ones are not told."""
            self.failures += 1
            if self.failures == 1:
                _logger.warning(
                    "a system metrics sample of run %s was not logged (%s: %s); it is "
                    "dropped, later samples are tried as usual and their failures not reported",
                    self._run_id,
                    type(err).__name__,
                    err,
                )

    return _Monitor


class TrialSystemMetrics:
    """MLflow's system-metrics monitor on one run, with a last sample at ``finish``."""

    def __init__(self, run_id: str, interval_s: float, tracking_uri: str | None) -> None:
        # resume_logging: a trial promoted or restored later samples into the same run,
        # its steps continuing where the last sampler stopped.
        self._monitor = _monitor_class()(
            run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=tracking_uri
        )

    @property
    def sampling_interval(self) -> float:
        return float(self._monitor.sampling_interval)

    def start(self) -> None:
        self._monitor.start()

    @property
    def failures(self) -> int:
        """Samples that could not be logged (dropped)."""
        return int(self._monitor.failures)

    def finish(self) -> None:
        """Stop sampling, take the last sample and log everything still held."""
        try:
            self._monitor.finish()  # joins the loop, flushes what it logged
        except Exception as err:
            self._monitor.note_failure(err)
        self._monitor.sample()
        try:
            self._monitor.mlflow_logger.flush()
        except Exception as err:
            self._monitor.note_failure(err)
