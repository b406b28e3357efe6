"""Determined's ``features/unmanaged`` example, here: a plain script that reports to the
platform without an experiment being submitted.

Run it with the stack's environment (``source .stack/env`` after ``make up``:
MLFLOW_TRACKING_URI, PREFECT_API_URL and the S3 settings) and the ``determined`` alias::

    python -m det_tasks.runner.script examples/core_v2/unmanaged.py --increment-by 2

It counts ``x += increment_by`` for ``batches`` batches, reports ``x`` every 10 and stores
one checkpoint at the end. The run is listed by ``det experiment list`` and shown in MLflow
like any experiment; it ends COMPLETED, or ERROR if the script raises. Run again with the
same ``--external-experiment-id`` and ``--external-trial-id`` (and more ``--batches``), it
rejoins that trial and continues from its newest checkpoint."""

import argparse
import logging

from determined.experimental import core_v2


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="unmanaged-counter")
    parser.add_argument("--increment-by", type=int, default=1)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--fail-at", type=int, default=None, help="raise at this batch")
    parser.add_argument("--external-experiment-id", default=None)
    parser.add_argument("--external-trial-id", default=None)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    core_v2.init(
        config=core_v2.Config(
            name=args.name,
            hparams={"increment_by": args.increment_by},
            searcher={"name": "single", "metric": "x", "smaller_is_better": False},
            external_experiment_id=args.external_experiment_id,
            external_trial_id=args.external_trial_id,
        )
    )
    x, start = 0, 0
    if core_v2.info.latest_checkpoint is not None:  # a rejoined trial continues
        with core_v2.checkpoint.restore_path(core_v2.info.latest_checkpoint) as path:
            x, start = (int(v) for v in path.joinpath("state").read_text().split(","))
    for batch in range(start, args.batches):
        if batch == args.fail_at:
            raise RuntimeError(f"failing on purpose at batch {batch}")
        x += args.increment_by
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            core_v2.train.report_training_metrics(steps_completed=steps_completed, metrics={"x": x})
    core_v2.train.report_validation_metrics(steps_completed=args.batches, metrics={"x": x})
    with core_v2.checkpoint.store_path({"steps_completed": args.batches}) as (path, _):
        path.joinpath("state").write_text(f"{x},{args.batches}")
    core_v2.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
