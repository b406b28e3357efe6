"""Stage 3 as Determined 0.38 writes it: no ``searcher.operations()``. The script trains to
its own length (``batches``) and reports ``x`` with the time metric (``batches``) as a
validation metric every 10 batches; ASHA (``time_metric: batches``, ``max_time``) decides
from those reports, and a trial it stops at a rung sees ``should_preempt()`` there: it
checkpoints and returns, and a promoted trial continues from that checkpoint."""

import logging
import pathlib
import time

import determined as det


def save_state(x: int, steps_completed: int, trial_id: int, path: pathlib.Path) -> None:
    path.joinpath("state").write_text(f"{x},{steps_completed},{trial_id}")


def load_state(trial_id: int, path: pathlib.Path) -> tuple[int, int]:
    x, steps_completed, ckpt_trial_id = path.joinpath("state").read_text().split(",")
    if str(ckpt_trial_id) != str(trial_id):
        return int(x), 0
    return int(x), int(steps_completed)


def main(core_context: det.core.Context, latest_checkpoint, trial_id, hparams: dict) -> None:
    x, starting_batch = 0, 0
    if latest_checkpoint is not None:
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            x, starting_batch = load_state(trial_id, path)
    batches = int(hparams.get("batches", 100))
    for batch in range(starting_batch, batches):
        x += hparams["increment_by"]
        time.sleep(hparams.get("batch_seconds", 0))
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            core_context.train.report_training_metrics(
                steps_completed=steps_completed, metrics={"x": x}
            )
            core_context.train.report_progress(steps_completed / batches)
            core_context.train.report_validation_metrics(
                steps_completed=steps_completed, metrics={"x": x, "batches": steps_completed}
            )
            with core_context.checkpoint.store_path({"steps_completed": steps_completed}) as (
                path,
                _storage_id,
            ):
                save_state(x, steps_completed, trial_id, path)
            if core_context.preempt.should_preempt():
                return


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "run it with det-tasks run asha.yaml (it needs a searcher)"
    with det.core.init() as core_context:
        main(core_context, info.latest_checkpoint, info.trial.trial_id, info.trial.hparams)
