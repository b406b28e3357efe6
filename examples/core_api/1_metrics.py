"""Stage 1 of the Core API tutorial: a counter that reports its value as a metric.

Each batch adds ``increment_by`` to ``x``; every 10 batches the script reports ``x`` as a
training metric, and at the end as a validation metric. Run it alone (``python3
1_metrics.py``: metrics are logged) or on the platform (``det-tasks run metrics.yaml``:
they reach the trial's MLflow run)."""

import logging

import determined as det


def main(core_context: det.core.Context, increment_by: int, batches: int) -> int:
    x = 0
    for batch in range(batches):
        x += increment_by
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            core_context.train.report_training_metrics(
                steps_completed=steps_completed, metrics={"x": x}
            )
    core_context.train.report_validation_metrics(steps_completed=batches, metrics={"x": x})
    return x


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    increment_by = info.trial.hparams["increment_by"] if info else 1
    with det.core.init() as core_context:
        main(core_context, increment_by, batches=50)
