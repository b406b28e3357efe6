"""Determined's ``features/unmanaged`` example, here: a plain script that reports to the
platform without an experiment being submitted.

Run it with the stack's environment (``eval "$(det-tasks env)"``, or MLFLOW_TRACKING_URI and
the S3 settings) and the ``determined`` alias::

    python -m det_tasks.runner.script examples/core_v2/unmanaged.py --increment-by 2

It counts ``x += increment_by`` for ``batches`` batches, reports ``x`` every 10 and stores
one checkpoint at the end. The run is listed by ``det experiment list`` and shown in MLflow
like any experiment; it ends COMPLETED, or ERROR if the script raises."""

import argparse
import logging

from determined.experimental import core_v2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="unmanaged-counter")
    parser.add_argument("--increment-by", type=int, default=1)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--fail-at", type=int, default=None, help="raise at this batch")
    args = parser.parse_args()
    hparams = {"increment_by": args.increment_by, "batches": args.batches}
    core_v2.init(
        config=core_v2.Config(
            name=args.name,
            hparams=hparams,
            searcher={"name": "single", "metric": "x", "smaller_is_better": False},
        )
    )
    x = 0
    for batch in range(args.batches):
        if batch == args.fail_at:
            raise RuntimeError(f"failing on purpose at batch {batch}")
        x += args.increment_by
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            core_v2.train.report_training_metrics(steps_completed=steps_completed, metrics={"x": x})
    core_v2.train.report_validation_metrics(steps_completed=args.batches, metrics={"x": x})
    with core_v2.checkpoint.store_path({"steps_completed": args.batches}) as (path, _):
        path.joinpath("state").write_text(str(x))
    core_v2.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
