"""What the flow asks of every worker (or of the ones it names) through ``Client.run``:
stop or preempt the trial a worker holds, forget a stop, say whether it holds a trial,
release it. Each finds the worker's held-trial plugin (cluster.held_trials) and answers
False or 0 on a worker without one."""

from __future__ import annotations

from distributed import Worker

from cluster.held_trials import PLUGIN_NAME, STOP_MODES, HeldTrialPlugin
from det_tasks.errors import TrialStopped

__all__ = [
    "forget_stop",
    "holds_a_trial",
    "holds_foreign_trial",
    "preempt_trial",
    "release_all",
    "request_stop",
]


def request_stop(experiment_key: str, mode: str, *, dask_worker: Worker) -> bool:
    """Stop the experiment's trial held on this worker at its next batch boundary
    (``Client.run`` passes ``dask_worker``); later train steps of the experiment stop at
    once. True if this worker held one of its trials."""
    if mode not in STOP_MODES:
        raise ValueError(f"stop mode must be one of {STOP_MODES}, got {mode!r}")
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, HeldTrialPlugin):
        return False
    return plugin.stop(experiment_key, mode)


def forget_stop(experiment_key: str, *, dask_worker: Worker) -> None:
    """The experiment is active again (activate): its trials train on this worker."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, HeldTrialPlugin):
        plugin.stop_modes.pop(experiment_key, None)


def holds_a_trial(*, dask_worker: Worker) -> bool:
    """Whether this worker holds any trial (``client.run``)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return isinstance(plugin, HeldTrialPlugin) and plugin.held is not None


def holds_foreign_trial(experiment_key: str | None, *, dask_worker: Worker) -> bool:
    """Whether this worker holds another experiment's active trial (``client.run``)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return isinstance(plugin, HeldTrialPlugin) and plugin.foreign_active(experiment_key)


def preempt_trial(experiment_key: str, trial_id: int, *, dask_worker: Worker) -> bool:
    """Ask this worker's trial ``trial_id`` of the experiment to stop at its next batch
    boundary for more urgent work (``Client.run``); True if the worker holds it."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return isinstance(plugin, HeldTrialPlugin) and plugin.preempt(experiment_key, trial_id)


def release_all(
    experiment_key: str | None = None, stopped_as: str | None = None, *, dask_worker: Worker
) -> int:
    """End the trial this worker holds (``client.run`` passes ``dask_worker``, at the end
    of an experiment): any, or only ``experiment_key``'s; ``stopped_as`` ends its run KILLED
    with that state. Returns the number released."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, HeldTrialPlugin) or plugin.held is None:
        return 0
    if experiment_key is not None and plugin.held.spec.experiment_run_key != experiment_key:
        return 0
    plugin.release(TrialStopped(stopped_as) if stopped_as else None)
    return 1
