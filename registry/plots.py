"""The learning-curve picture logged to an experiment's parent run."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from mlflow.tracking import MlflowClient

__all__ = ["log_learning_curves"]


def log_learning_curves(
    client: MlflowClient, parent_run_id: str, trial_runs: list[Any], metric: str
) -> Path | None:
    """Plot every trial's validation ``metric`` against batches; log it as a PNG artifact."""
    key = f"validation/{metric}"
    fig, ax = plt.subplots(figsize=(8, 5))
    plotted = 0
    for run in trial_runs:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        if history:
            ax.plot(
                [m.step for m in history],
                [m.value for m in history],
                marker="o",
                label=run.info.run_name or run.info.run_id[:8],
            )
            plotted += 1
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("batches")
    ax.set_ylabel(metric)
    ax.set_title(f"validation {metric} per trial")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(tempfile.mkdtemp()) / "learning_curves.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    client.log_artifact(parent_run_id, str(out))
    return out
