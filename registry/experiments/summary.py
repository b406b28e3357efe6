"""The experiment's winner on its parent run, so MLflow's runs table shows it without
expanding the trials: the best trial's searcher metric (at the step it was reached), its
hyperparameters and the best checkpoint's URI."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from registry.runs.tracking import TRIAL_TAG

__all__ = [
    "BEST_TAG",
    "BestTrial",
    "best_trial",
    "best_trial_tags",
    "log_best_tags",
    "log_best_trial",
]

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
    step, then the lower trial id) and its best checkpoint, read as ``det experiment
    describe`` and the trials table read them (registry.experiments.view.trial_progress)."""
    from registry.experiments.view import read_trial_progress, trial_order

    sign = 1.0 if smaller_is_better else -1.0
    scored = []
    for run in trials:
        progress = read_trial_progress(client, run, metric, smaller_is_better)
        if progress.best is not None:
            trial_id = run.data.tags.get(TRIAL_TAG, "")
            key = (sign * progress.best, progress.best_step or 0, trial_order(trial_id))
            scored.append((key, trial_id, run, progress, progress.best))
    if not scored:
        return None
    _, trial_id, run, progress, value = min(scored, key=lambda s: s[0])
    return BestTrial(
        run_id=run.info.run_id,
        trial_id=trial_id,
        metric=metric,
        value=float(value),
        step=int(progress.best_step or 0),
        hparams={k[3:]: v for k, v in run.data.params.items() if k.startswith("hp.")},
        checkpoint_uri=progress.checkpoint,
    )


def best_trial_tags(best: BestTrial) -> dict[str, str]:
    """The parent run's ``det.best.*`` tags for ``best``: trial, run, step, the metric's
    value, ``hp.<name>`` and its checkpoint."""
    tags = {
        f"{BEST_TAG}trial_id": best.trial_id,
        f"{BEST_TAG}run_id": best.run_id,
        f"{BEST_TAG}step": str(best.step),
        f"{BEST_TAG}{best.metric}": repr(best.value),
        **{f"{BEST_TAG}hp.{k}": v for k, v in best.hparams.items()},
    }
    if best.checkpoint_uri:
        tags[f"{BEST_TAG}checkpoint"] = best.checkpoint_uri
    return tags


def log_best_tags(client: MlflowClient, parent_run_id: str, best: BestTrial) -> None:
    """Only the ``det.best.*`` tags (the live trials table, while the experiment runs)."""
    tags = best_trial_tags(best)
    client.log_batch(parent_run_id, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])


def log_best_trial(client: MlflowClient, parent_run_id: str, best: BestTrial) -> None:
    """The ``det.best.*`` tags and the metric ``validation/<metric>`` at the best step, so
    the parent row shares the trials' column."""
    tags = best_trial_tags(best)
    metric = Metric(f"validation/{best.metric}", best.value, int(time.time() * 1000), best.step)
    client.log_batch(
        parent_run_id, metrics=[metric], tags=[RunTag(k, v[:5000]) for k, v in tags.items()]
    )


def _trial_order(trial_id: str) -> tuple[int, str]:
    return (int(trial_id), "") if trial_id.isdigit() else (1 << 62, trial_id)
