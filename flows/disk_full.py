"""A trial whose checkpoint found no room pauses the experiment instead of failing it.

A full disk is not the experiment's fault, and nothing is lost: the checkpoint that did not
fit was never published (det_tasks.checkpoints.disk_full), and every trial's last good
checkpoint is intact. So the experiment ends as a pause does (its runs KILLED with det.state
PAUSED, every held trial released) and its last line says what is full, which checkpoint is
the last good one, and the ``--activate`` command that continues it once there is room.
"""

from __future__ import annotations

import contextlib
from typing import Any

from cluster.steps import stop_everywhere
from cluster.stop_requests import record_stop
from det_tasks.checkpoints.disk_full import NoRoomForCheckpoint
from flows.stopping import StopControl
from registry.checkpoints.store import checkpoint_records
from registry.runs.tracking import PARENT_TAG, TRIAL_TAG, ExperimentRuns

__all__ = ["paused_for_room"]

_PAUSED = "PAUSED"


def paused_for_room(
    client: Any,  # a distributed.Client
    runs: ExperimentRuns,
    run_key: str,
    table: Any,  # flows.trial_table.TrialTable
    stop: StopControl,
    err: BaseException,
) -> bool:
    """If ``err`` is a trial's full disk: stop the experiment's other trials where they are
    (their last checkpoints are what they continue from), record a pause whose reason
    (``stop.why``) names the full folder and the trial's last good checkpoint, and return
    True; else False (the caller ends the experiment as failed)."""
    if not isinstance(err, NoRoomForCheckpoint):
        return False
    with contextlib.suppress(Exception):  # best effort: the pause is recorded regardless
        stop_everywhere(client, run_key, "kill")  # their checkpoints would not fit either
    with contextlib.suppress(Exception):
        record_stop(client, run_key, "pause")
    stop.request("pause")
    stop.why = f"{err}; {_last_good(runs, err.trial_id)}; once there is room"
    with contextlib.suppress(KeyError):
        table.set_state(int(err.trial_id), _PAUSED)
    return True


def _last_good(runs: ExperimentRuns, trial_id: int | str) -> str:
    """The trial's newest recorded checkpoint, in words."""
    try:
        found = runs.client.search_runs(
            [runs.experiment_id],
            filter_string=(
                f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{PARENT_TAG}` = "
                f"'{runs.parent_run_id}'"
            ),
            max_results=1,
        )
        records = checkpoint_records(runs.client, found[0].info.run_id) if found else []
    except Exception as err:  # MLflow unreachable: the records say it once it answers
        return f"its last good checkpoint could not be read ({type(err).__name__})"
    if not records:
        return "it has no checkpoint yet (it continues from batch 0)"
    last = records[-1]
    return f"its last good checkpoint is at batch {last['steps_completed']} ({last['uri']})"
