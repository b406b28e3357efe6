"""TPE with ASHA pruning (searcher.name: optuna) against random search and Determined's
adaptive_asha on examples/mnist/adaptive.yaml's space, at the same training budget.

Each run drives a searcher through det_tasks' Searcher interface (what the flow does),
training the example's own MNistTrial in this process, one thread, trial state kept in
memory between segments (the warm worker): no Prefect, MLflow or Dask, so the figures are
the searchers', not the platform's. Reports are handled first in, first out; the optuna
searcher has the example's two trials open at a time. Every method may spend ``--budget``
training batches (default 16 trials x 200 batches, what random search spends with the
example's 16 trials); adaptive_asha and optuna get max_trials 64 and stop being handed work
once the budget is spent.

Per (method, seed) it records the best validation_error reached and the budget spent when a
validation first reached ``--target``; it prints medians and the range over seeds, and the
cost of one TPE ask (ms) against study sizes. Runs two (method, seed) jobs at a time.

    python bench/optuna_vs_asha.py [--seeds 5] [--budget 3200] [--target 0.05] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "examples" / "mnist"
METHODS = ("tpe+asha", "random", "adaptive_asha")


def _config(method: str, seed: int, max_length: int) -> Any:
    import yaml

    from det_tasks.config.loader import parse_config

    raw = yaml.safe_load((MNIST / "adaptive.yaml").read_text())
    searcher = raw["searcher"]
    searcher.pop("time_metric")
    searcher.pop("max_time")
    searcher["max_length"] = {"batches": max_length}
    searcher["max_trials"] = 64
    if method == "random":
        for key in ("mode", "divisor", "max_rungs"):
            searcher.pop(key)
        searcher.update(name="random", max_trials=16)
    elif method == "tpe+asha":
        searcher.pop("mode")
        searcher.update(name="optuna", sampler="tpe", pruner="asha")
    raw["reproducibility"] = {"experiment_seed": seed}
    return parse_config(raw)


class _Trials:
    """The example's trials held in memory, each trained from where it stopped."""

    def __init__(self) -> None:
        import torch

        from det_tasks import compat

        compat.install()  # model_def imports `determined`
        sys.path.insert(0, str(MNIST))
        torch.set_num_threads(1)
        self.held: dict[int, dict[str, Any]] = {}

    def run(self, trial_id: int, hparams: dict[str, Any], until: int) -> tuple[int, float]:
        """Train to ``until`` batches, validate; returns (batches trained now, error)."""
        import model_def  # type: ignore[import-not-found]
        import torch

        from det_tasks import pytorch as det_pytorch

        if trial_id not in self.held:
            context = det_pytorch.init(
                hparams=hparams,
                exp_conf={"hyperparameters": hparams},
                enable_tensorboard_logging=False,
                seed=trial_id,
            )
            trial = model_def.MNistTrial(context)
            batches = trial.build_training_data_loader().get_data_loader(seed=trial_id, repeat=True)
            self.held[trial_id] = {"trial": trial, "batches": iter(batches), "at": 0}
        held = self.held[trial_id]
        trial, start = held["trial"], held["at"]
        trial.model.train()
        for batch_idx in range(start, until):
            trial.train_batch(next(held["batches"]), 0, batch_idx)
        held["at"] = until
        trial.model.eval()
        validation = trial.build_validation_data_loader().get_data_loader(seed=0)
        with torch.no_grad():
            errors = [float(trial.evaluate_batch(b)["validation_error"]) for b in validation]
        return until - start, statistics.fmean(errors)


def run_one(method: str, seed: int, budget: int, max_length: int, target: float) -> dict:
    from det_tasks.searchers.choose import make_searcher

    searcher = make_searcher(_config(method, seed, max_length))
    trials, todo = _Trials(), searcher.start()
    spent, best, reached, trial_ids = 0, 1.0, None, set()
    started = time.perf_counter()
    while todo and spent < budget:
        work = todo.pop(0)
        trained, error = trials.run(work.trial_id, work.hparams, work.batches or max_length)
        spent += trained
        trial_ids.add(work.trial_id)
        best = min(best, error)
        if reached is None and error <= target:
            reached = spent
        todo += searcher.report(work.trial_id, work.batches or max_length, error)
        if work.trial_id in searcher.pruned() or not any(w.trial_id == work.trial_id for w in todo):
            trials.held.pop(work.trial_id, None)  # released: its memory is freed
    return {
        "method": method,
        "seed": seed,
        "best_error": best,
        "batches_to_target": reached,
        "spent": spent,
        "trials": len(trial_ids),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def tpe_ask_ms(sizes: tuple[int, ...] = (10, 50, 200)) -> dict[int, float]:
    """Median time of one TPE ask on the example's 4-parameter space, after ``n`` told."""
    import optuna

    from det_tasks.searchers.optuna.space import search_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = search_space(_config("tpe+asha", 0, 200).hyperparameters)
    out = {}
    for n in sizes:
        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
        for i in range(n):
            trial = study.ask(space.distributions)
            study.tell(trial, (i * 7919 % 101) / 101)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            trial = study.ask(space.distributions)
            times.append((time.perf_counter() - t0) * 1000)
            study.tell(trial, 0.5)
        out[n] = round(statistics.median(times), 2)
    return out


def _summary(rows: list[dict], method: str) -> str:
    mine = [r for r in rows if r["method"] == method]
    best = sorted(r["best_error"] for r in mine)
    hit = [r["batches_to_target"] for r in mine]
    reached = sorted(h for h in hit if h is not None)
    to_target = (
        f"median {statistics.median(reached):.0f} [{reached[0]}-{reached[-1]}]" if reached else "-"
    )
    return (
        f"{method:14s} best error median {statistics.median(best):.4f} "
        f"[{best[0]:.4f}-{best[-1]:.4f}]  batches to target: {to_target}, "
        f"reached in {len(reached)}/{len(mine)}  trials median "
        f"{statistics.median(r['trials'] for r in mine):.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=16 * 200)
    parser.add_argument("--target", type=float, default=0.05)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true", help="1 seed, budget 60, length 16")
    args = parser.parse_args()
    seeds, budget, length = args.seeds, args.budget, 200
    if args.smoke:
        seeds, budget, length = 1, 60, 16
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = [(m, s, budget, length, args.target) for s in range(seeds) for m in METHODS]
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done in as_completed([pool.submit(run_one, *job) for job in jobs]):
            rows.append(done.result())
            print(json.dumps(rows[-1]), flush=True)  # a long run shows its progress
    print(f"budget {budget} batches per run, target validation_error <= {args.target}:")
    for method in METHODS:
        print(_summary(rows, method))
    print("TPE ask, ms (median of 20) after n trials:", tpe_ask_ms())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
