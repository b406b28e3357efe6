"""The pictures logged to an experiment's parent run: the learning-curves PNG and one
interactive plotly page (``experiment.html``: every trial's learning curve and the searcher
metric against each hyperparameter the search varied, the view Determined's experiment page
gave), which MLflow's artifact viewer renders."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

__all__ = ["TrialCurve", "log_interactive_plots", "log_learning_curves", "trial_curves"]

HTML_NAME = "experiment.html"


@dataclasses.dataclass(frozen=True)
class TrialCurve:
    label: str
    steps: list[int]
    values: list[float]
    hparams: dict[str, str]


def trial_curves(client: MlflowClient, trial_runs: list[Any], metric: str) -> list[TrialCurve]:
    """Each trial's validation ``metric`` against batches (trials never validated left out)."""
    curves = []
    for run in trial_runs:
        history = client.get_metric_history(run.info.run_id, f"validation/{metric}")
        history = sorted(history, key=lambda m: m.step)
        if history:
            curves.append(
                TrialCurve(
                    label=run.info.run_name or run.info.run_id[:8],
                    steps=[m.step for m in history],
                    values=[m.value for m in history],
                    hparams={k[3:]: v for k, v in run.data.params.items() if k.startswith("hp.")},
                )
            )
    return sorted(curves, key=lambda c: _natural(c.label))


def log_learning_curves(
    client: MlflowClient, parent_run_id: str, curves: list[TrialCurve], metric: str
) -> Path | None:
    """Plot every trial's validation ``metric`` against batches; log it as a PNG artifact."""
    if not curves:
        return None
    # Imported here, not at module level: every warm trial worker imports this module, and
    # matplotlib cost each of them ~18 MB of private memory (measured) for a plot it never draws.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for curve in curves:
        ax.plot(curve.steps, curve.values, marker="o", label=curve.label)
    ax.set_xlabel("batches")
    ax.set_ylabel(metric)
    ax.set_title(f"validation {metric} per trial")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = Path(tempfile.mkdtemp()) / "learning_curves.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    client.log_artifact(parent_run_id, str(out))
    return out


def log_interactive_plots(
    client: MlflowClient,
    parent_run_id: str,
    curves: list[TrialCurve],
    metric: str,
    smaller_is_better: bool,
) -> Path | None:
    """One self-contained HTML page (plotly.js inlined: the UI may have no internet)."""
    if not curves:
        return None
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    # Only the hyperparameters the search varied: a constant one says nothing.
    names = sorted(
        k
        for k in {k for c in curves for k in c.hparams}
        if len({c.hparams.get(k) for c in curves}) > 1
    )
    best = min if smaller_is_better else max
    fig = make_subplots(
        rows=1 + len(names),
        cols=1,
        subplot_titles=[f"{metric} per trial (validation)"]
        + [f"best {metric} against {name}" for name in names],
        vertical_spacing=0.3 / max(len(names), 1),
    )
    for curve in curves:
        fig.add_trace(
            go.Scatter(x=curve.steps, y=curve.values, mode="lines+markers", name=curve.label),
            row=1,
            col=1,
        )
    for row, name in enumerate(names, start=2):
        scored = [
            (c, best(v for v in c.values if math.isfinite(v)))
            for c in curves
            if any(math.isfinite(v) for v in c.values)
        ]
        fig.add_trace(
            go.Scatter(
                x=[_number(c.hparams.get(name, "")) for c, _ in scored],
                y=[value for _, value in scored],
                mode="markers",
                text=[c.label for c, _ in scored],
                name=name,
                showlegend=False,
            ),
            row=row,
            col=1,
        )
        fig.update_xaxes(title_text=name, row=row, col=1)
        fig.update_yaxes(title_text=metric, row=row, col=1)
    fig.update_xaxes(title_text="batches", row=1, col=1)
    fig.update_yaxes(title_text=metric, row=1, col=1)
    fig.update_layout(height=420 * (1 + len(names)), title_text=f"experiment: {metric}")
    out = Path(tempfile.mkdtemp()) / HTML_NAME
    fig.write_html(out, include_plotlyjs=True, full_html=True)
    client.log_artifact(parent_run_id, str(out))
    return out


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _natural(label: str) -> tuple[str, int]:
    head = label.rstrip("0123456789")
    tail = label[len(head) :]
    return head, int(tail) if tail else -1
