"""Stage 2 of the Core API tutorial: the counter checkpoints, stops when asked, and resumes.

Every 10 batches it stores ``x`` and the batch in a checkpoint, then asks
``should_preempt()``: a pause, cancel, a more urgent experiment or SIGTERM make it return
there, and the platform continues it later from ``latest_checkpoint`` with the value it
had. ``batch_seconds`` slows each batch down (to give a stop request time to arrive)."""

import logging
import pathlib
import time

import determined as det


def save_state(x: int, steps_completed: int, trial_id: int, path: pathlib.Path) -> None:
    path.joinpath("state").write_text(f"{x},{steps_completed},{trial_id}")


def load_state(trial_id: int, path: pathlib.Path) -> tuple[int, int]:
    """(x, batches trained): a checkpoint of another trial gives its x but no progress."""
    x, steps_completed, ckpt_trial_id = path.joinpath("state").read_text().split(",")
    if str(ckpt_trial_id) != str(trial_id):
        return int(x), 0
    return int(x), int(steps_completed)


def main(core_context: det.core.Context, latest_checkpoint, trial_id, hparams: dict) -> None:
    x, starting_batch = 0, 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            x, starting_batch = load_state(trial_id, path)
    batches = int(hparams.get("batches", 50))
    for batch in range(starting_batch, batches):
        x += hparams["increment_by"]
        time.sleep(hparams.get("batch_seconds", 0))
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            core_context.train.report_training_metrics(
                steps_completed=steps_completed, metrics={"x": x}
            )
            with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (
                path,
                _storage_id,
            ):
                save_state(x, steps_completed, trial_id, path)
            if core_context.preempt.should_preempt():
                return
    core_context.train.report_validation_metrics(steps_completed=batches, metrics={"x": x})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    if info is None:  # run alone: a local trial of its own
        latest, trial_id, hparams = None, "local", {"increment_by": 1}
    else:
        latest, trial_id, hparams = info.latest_checkpoint, info.trial.trial_id, info.trial.hparams
    with det.core.init() as core_context:
        main(core_context, latest, trial_id, hparams)
