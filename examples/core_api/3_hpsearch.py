"""Stage 3 of the Core API tutorial: the counter under a hyperparameter search.

The searcher picks ``increment_by`` and the length (``searcher.operations()``, the legacy
API scripts written before Determined 0.38 use; a rung of an ASHA search is one such
length). The searcher metric ``x`` is reported as a validation metric; checkpoints and
``should_preempt()`` work as in stage 2."""

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
    batch = starting_batch
    for op in core_context.searcher.operations():
        while batch < op.length:
            x += hparams["increment_by"]
            time.sleep(hparams.get("batch_seconds", 0))
            batch += 1
            if batch % 10 == 0:
                core_context.train.report_training_metrics(steps_completed=batch, metrics={"x": x})
                op.report_progress(batch)
                with core_context.checkpoint.store_path({"steps_completed": batch}) as (path, _):
                    save_state(x, batch, trial_id, path)
                if core_context.preempt.should_preempt():
                    return
        core_context.train.report_validation_metrics(steps_completed=batch, metrics={"x": x})
        op.report_completed(x)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "run it with det-tasks run hpsearch.yaml (it needs a searcher)"
    with det.core.init() as core_context:
        main(core_context, info.latest_checkpoint, info.trial.trial_id, info.trial.hparams)
