"""The experiment's winner on its parent run, so MLflow's runs table shows it without
expanding the trials: the best trial's searcher metric (at the step it was reached), its
hyperparameters and the best checkpoint's URI."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from registry.checkpoints import checkpoint_records, rank_by_metric
from registry.tracking import TRIAL_TAG

__all__ = ["BEST_TAG", "BestTrial", "best_trial", "log_best_trial"]

BEST_TAG = "det.best."


@dataclasses.dataclass(frozen=True)
class BestTrial:
    run_id: str
    trial_id: str
    metric: str
    value: float
    step: int
    hparams: dict[str, str]
    checkpoint_uri: str | None


def best_trial(
    client: MlflowClient, trials: list[Any], metric: str, smaller_is_better: bool
) -> BestTrial | None:
    """The trial whose validation ``metric`` was best at any validation (ties: the earlier
    step, then the lower trial id), with the best checkpoint across all trials."""
    sign = 1.0 if smaller_is_better else -1.0
    scored: list[tuple[float, int, str, Any]] = []
    for run in trials:
        for m in client.get_metric_history(run.info.run_id, f"validation/{metric}"):
            if math.isfinite(m.value):
                scored.append((sign * m.value, m.step, run.data.tags.get(TRIAL_TAG, ""), run))
    if not scored:
        return None
    scored.sort(key=lambda s: (s[0], s[1], _trial_order(s[2])))
    key, step, trial_id, run = scored[0]
    records = [r for t in trials for r in checkpoint_records(client, t.info.run_id)]
    ranked = rank_by_metric(records, metric, smaller_is_better)
    return BestTrial(
        run_id=run.info.run_id,
        trial_id=trial_id,
        metric=metric,
        value=sign * key,
        step=step,
        hparams={k[3:]: v for k, v in run.data.params.items() if k.startswith("hp.")},
        checkpoint_uri=str(ranked[0]["uri"]) if ranked else None,
    )


def log_best_trial(client: MlflowClient, parent_run_id: str, best: BestTrial) -> None:
    """Tags ``det.best.*`` (trial, run, step, checkpoint, ``hp.<name>``) and the metric
    ``validation/<metric>`` at the best step, so the parent row shares the trials' column."""
    tags = {
        f"{BEST_TAG}trial_id": best.trial_id,
        f"{BEST_TAG}run_id": best.run_id,
        f"{BEST_TAG}step": str(best.step),
        f"{BEST_TAG}{best.metric}": repr(best.value),
        **{f"{BEST_TAG}hp.{k}": v for k, v in best.hparams.items()},
    }
    if best.checkpoint_uri:
        tags[f"{BEST_TAG}checkpoint"] = best.checkpoint_uri
    metric = Metric(f"validation/{best.metric}", best.value, int(time.time() * 1000), best.step)
    client.log_batch(
        parent_run_id, metrics=[metric], tags=[RunTag(k, v[:5000]) for k, v in tags.items()]
    )


def _trial_order(trial_id: str) -> tuple[int, str]:
    return (int(trial_id), "") if trial_id.isdigit() else (1 << 62, trial_id)
