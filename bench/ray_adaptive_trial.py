"""The Ray Tune side of bench/adaptive_vs_ray.py; runs under the bench's own Ray venv.

The search of examples/mnist/adaptive.yaml as a Ray Tune user would write it: the example's
own trial class (``model_def.MNistTrial``: same CNN, digits data, Adadelta, train_batch and
evaluate_batch) built on a det_tasks context, driven by a plain loop in a function trainable
that validates over the whole validation set and checkpoints model + optimizer state at each
report. ASHA decides at the reports (the rungs, and the end). Prints ``RESULT {json}`` last.

    python bench/ray_adaptive_trial.py '{"samples": 16, "max_t": 200, "grace_period": 12}'

Needs PYTHONPATH=<repo root>:<repo>/examples/mnist: Ray's workers do not inherit sys.path.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

RESULT = "RESULT "
SPACE_SEED = 42  # reproducibility.experiment_seed of adaptive.yaml


def report_points(max_t: int, grace_period: int, reduction_factor: int) -> list[int]:
    """ASHA's rungs (grace_period * reduction_factor**k below max_t), then max_t."""
    points, t = [], grace_period
    while t < max_t:
        points.append(t)
        t *= reduction_factor
    return [*points, max_t]


def train_mnist(config: dict[str, Any]) -> None:
    """One trial: train batch by batch, validate + checkpoint + report at each point."""
    import torch
    from ray import tune

    from det_tasks import compat
    from det_tasks import pytorch as det_pytorch

    compat.install()  # model_def imports `determined`
    import model_def

    # Two trials at a time, each on half of the cores: what each of the project's two Dask
    # workers gets (det_tasks.cpu_threads; one thread each on this 2-core VM).
    from det_tasks.cpu_threads import threads_per_process

    torch.set_num_threads(threads_per_process(2))
    points = config["report_points"]
    hparams = {k: v for k, v in config.items() if k != "report_points"}
    seed = zlib.crc32(tune.get_context().get_trial_id().encode()) % 2**31
    context = det_pytorch.init(
        hparams=hparams,
        exp_conf={"hyperparameters": hparams},
        enable_tensorboard_logging=False,
        seed=seed,
    )
    trial = model_def.MNistTrial(context)
    batches = iter(trial.build_training_data_loader().get_data_loader(seed=seed, repeat=True))
    validation = trial.build_validation_data_loader().get_data_loader(seed=seed)
    done = 0
    for point in points:
        trial.model.train()
        for batch_idx in range(done, point):
            trial.train_batch(next(batches), 0, batch_idx)
        done = point
        trial.model.eval()
        with torch.no_grad():
            outputs = [trial.evaluate_batch(batch) for batch in validation]
        metrics: dict[str, Any] = {
            name: float(torch.stack([torch.as_tensor(o[name]) for o in outputs]).mean())
            for name in outputs[0]
        }
        metrics["batches"] = point
        with tempfile.TemporaryDirectory() as ckpt:
            torch.save(
                {
                    "model": trial.model.state_dict(),
                    "optimizer": trial.optimizer.state_dict(),
                    "batches": point,
                },
                Path(ckpt) / "state.pt",
            )
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(ckpt))


def main() -> None:
    args = json.loads(sys.argv[1])
    samples, max_t, grace = args["samples"], args["max_t"], args["grace_period"]
    factor = args.get("reduction_factor", 4)
    started = time.perf_counter()
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    imported = time.perf_counter()
    ray.init(num_cpus=2)
    initialised = time.perf_counter()
    space = {
        "global_batch_size": 64,
        "learning_rate": tune.loguniform(10**-1.5, 10**0.3),
        "n_filters1": tune.randint(8, 49),  # upper bound exclusive: 8..48 as in the YAML
        "n_filters2": tune.randint(16, 65),
        "dropout": tune.uniform(0.2, 0.6),
        "report_points": report_points(max_t, grace, factor),
    }
    with tempfile.TemporaryDirectory() as storage:
        tuner = tune.Tuner(
            train_mnist,
            param_space=space,
            tune_config=tune.TuneConfig(
                metric="validation_error",
                mode="min",
                scheduler=ASHAScheduler(
                    time_attr="batches",
                    max_t=max_t,
                    grace_period=grace,
                    reduction_factor=factor,
                ),
                search_alg=BasicVariantGenerator(random_state=SPACE_SEED),
                num_samples=samples,
                max_concurrent_trials=2,
            ),
            run_config=tune.RunConfig(storage_path=storage, name="mnist-adaptive"),
        )
        results = tuner.fit()
        finished = time.perf_counter()
        frames = [r.metrics_dataframe for r in results if r.metrics_dataframe is not None]
        report = {
            "ray": ray.__version__,
            "import_s": imported - started,
            "init_s": initialised - imported,
            "from_ray_init_s": finished - imported,  # before ray.init -> end of fit()
            "after_ray_init_s": finished - initialised,  # the 53 s
            "trials": len(results),
            "trial_errors": [str(r.error) for r in results if r.error],
            "batches_trained": sum(int(r.metrics.get("batches", 0)) for r in results),
            "best_validation_error": min(float(f["validation_error"].min()) for f in frames),
        }
    ray.shutdown()
    print(RESULT + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
