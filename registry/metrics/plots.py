"""The pictures logged to an experiment's parent run: the learning-curves PNG and one
interactive plotly page (``experiment.html``: every trial's learning curve and the searcher
metric against each hyperparameter the search varied, the view Determined's experiment page
gave), which MLflow's artifact viewer renders.

Each trial keeps one colour in both, none repeated however many trials there are (a
qualitative palette up to 20, then evenly spaced along a continuous scale), and a
hyperparameter sampled ``type: log`` is drawn on a log axis."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlflow.tracking import MlflowClient

__all__ = [
    "TrialCurve",
    "interactive_figure",
    "learning_curves_figure",
    "log_interactive_plots",
    "log_learning_curves",
    "log_scaled",
    "trial_colors",
    "trial_curves",
]

HTML_NAME = "experiment.html"
CURVES_NAME = "learning_curves.png"
LEGEND_MAX_TRIALS = 48  # two columns beside the axes


@dataclasses.dataclass(frozen=True)
class TrialCurve:
    label: str
    steps: list[int]
    values: list[float]
    hparams: dict[str, str]


# Histories read at once at an experiment's end: one request a trial, which one after
# another kept a 1,024-trial experiment's end waiting on round trips for minutes.
HISTORY_READERS = 8


def trial_curves(client: MlflowClient, trial_runs: list[Any], metric: str) -> list[TrialCurve]:
    """Each trial's validation ``metric`` against batches (trials never validated left out)."""

    def history(run: Any) -> list[Any]:
        found = client.get_metric_history(run.info.run_id, f"validation/{metric}")
        return sorted(found, key=lambda m: m.step)

    with ThreadPoolExecutor(HISTORY_READERS, thread_name_prefix="det-tasks-curves") as pool:
        histories = list(pool.map(history, trial_runs))
    curves = [
        TrialCurve(
            label=run.info.run_name or run.info.run_id[:8],
            steps=[m.step for m in points],
            values=[m.value for m in points],
            hparams={k[3:]: v for k, v in run.data.params.items() if k.startswith("hp.")},
        )
        for run, points in zip(trial_runs, histories, strict=True)
        if points
    ]
    return sorted(curves, key=lambda c: _natural(c.label))


def log_learning_curves(
    client: MlflowClient, parent_run_id: str, curves: list[TrialCurve], metric: str
) -> str | None:
    """Plot every trial's validation ``metric`` against batches; log it as a PNG artifact
    (its name returned; MLflow's ``log_figure`` writes it in a folder it removes)."""
    if not curves:
        return None
    fig = learning_curves_figure(curves, metric)
    save = {"dpi": 100, "bbox_inches": "tight"}
    client.log_figure(parent_run_id, fig, CURVES_NAME, save_kwargs=save)
    return CURVES_NAME


def learning_curves_figure(curves: list[TrialCurve], metric: str) -> Any:
    """The matplotlib figure of ``learning_curves.png``: one coloured line per trial."""
    # Imported here, not at module level: every warm trial worker imports this module, and
    # matplotlib cost each of them ~18 MB of private memory (measured) for a plot it never draws.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for curve, color in zip(curves, trial_colors(len(curves)), strict=True):
        ax.plot(curve.steps, curve.values, marker="o", label=curve.label, color=color)
    ax.set_xlabel("batches trained")
    ax.set_ylabel(f"validation {metric}")
    ax.grid(alpha=0.3)
    if len(curves) > LEGEND_MAX_TRIALS:
        # A legend of hundreds of names is unreadable, and drawing one took minutes (1,024
        # trials: 43 columns); experiment.html names each curve under the pointer.
        ax.set_title(f"{metric} per trial ({len(curves)} trials; names in {HTML_NAME})")
        return fig
    ax.set_title(f"{metric} per trial")
    # Beside the axes, not over the curves (the figure grows to fit it).
    ax.legend(
        fontsize="small",
        ncol=max(1, math.ceil(len(curves) / 24)),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    return fig


def log_interactive_plots(
    client: MlflowClient,
    parent_run_id: str,
    curves: list[TrialCurve],
    metric: str,
    smaller_is_better: bool,
    raw_config: dict[str, Any] | None = None,
) -> str | None:
    """One self-contained HTML page (plotly.js inlined: the UI may have no internet);
    ``raw_config``'s ``type: log`` hyperparameters get log axes. Returns the artifact's
    name (written by MLflow's ``log_figure`` in a folder it removes)."""
    if not curves:
        return None
    fig = interactive_figure(curves, metric, smaller_is_better, raw_config or {})
    save = {"include_plotlyjs": True, "full_html": True}  # MLflow's default: the CDN
    client.log_figure(parent_run_id, fig, HTML_NAME, save_kwargs=save)
    return HTML_NAME


def interactive_figure(
    curves: list[TrialCurve], metric: str, smaller_is_better: bool, raw_config: dict[str, Any]
) -> Any:
    """The plotly figure of ``experiment.html``: the learning curves, then the best metric
    against each hyperparameter the trials differ in (log axis for ``type: log`` ones)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    # Only the hyperparameters the search varied: a constant one says nothing.
    names = sorted(
        k
        for k in {k for c in curves for k in c.hparams}
        if len({c.hparams.get(k) for c in curves}) > 1
    )
    best = min if smaller_is_better else max
    logs = log_scaled(raw_config)
    colors = trial_colors(len(curves))
    fig = make_subplots(
        rows=1 + len(names),
        cols=1,
        subplot_titles=[f"{metric} per trial"]
        + [
            f"best {metric} against {name}" + (" (log scale)" if name in logs else "")
            for name in names
        ],
        vertical_spacing=0.3 / max(len(names), 1),
    )
    for curve, color in zip(curves, colors, strict=True):
        fig.add_trace(
            go.Scatter(
                x=curve.steps,
                y=curve.values,
                mode="lines+markers",
                name=curve.label,
                line={"color": color},
            ),
            row=1,
            col=1,
        )
    color_of = dict(zip((c.label for c in curves), colors, strict=True))
    for row, name in enumerate(names, start=2):
        _add_best_against(fig, row, name, curves, best, color_of, log_axis=name in logs)
        fig.update_yaxes(title_text=f"best validation {metric}", row=row, col=1)
    fig.update_xaxes(title_text="batches trained", row=1, col=1)
    fig.update_yaxes(title_text=f"validation {metric}", row=1, col=1)
    fig.update_layout(
        height=420 * (1 + len(names)),
        title_text=f"{metric} per trial, and against each hyperparameter the search varied",
    )
    return fig


def _add_best_against(
    fig: Any,
    row: int,
    name: str,
    curves: list[TrialCurve],
    best: Any,
    color_of: dict[str, str],
    log_axis: bool,
) -> None:
    """Row ``row``: each trial's best metric against hyperparameter ``name``."""
    import plotly.graph_objects as go

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
            marker={"color": [color_of[c.label] for c, _ in scored], "size": 9},
            text=[c.label for c, _ in scored],
            name=name,
            showlegend=False,
        ),
        row=row,
        col=1,
    )
    fig.update_xaxes(title_text=name, type="log" if log_axis else None, row=row, col=1)


def trial_colors(count: int) -> list[str]:
    """``count`` distinct colours (``#rrggbb``): a qualitative palette while it lasts (10,
    then 20), then evenly spaced along a continuous scale."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if count <= 10:
        return [to_hex(c) for c in colormaps["tab10"].colors[:count]]  # type: ignore[attr-defined]
    if count <= 20:
        return [to_hex(c) for c in colormaps["tab20"].colors[:count]]  # type: ignore[attr-defined]
    scale = colormaps["turbo"]
    return [to_hex(scale(0.05 + 0.9 * i / (count - 1))) for i in range(count)]


def log_scaled(raw_config: dict[str, Any]) -> set[str]:
    """The flattened names (as in ``hp.<name>``) of the hyperparameters sampled ``type: log``."""
    from det_tasks.config.hyperparameters import LogHP, parse_hyperparameters

    try:
        space = parse_hyperparameters(raw_config.get("hyperparameters") or {})
    except ValueError:  # validated before any trial ran; a partial config has no space
        return set()

    def walk(node: dict[str, Any], prefix: str) -> set[str]:
        names: set[str] = set()
        for key, value in node.items():
            if isinstance(value, dict):
                names |= walk(value, f"{prefix}{key}.")
            elif isinstance(value, LogHP):
                names.add(f"{prefix}{key}")
        return names

    return walk(space, "")


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _natural(label: str) -> tuple[str, int]:
    head = label.rstrip("0123456789")
    tail = label[len(head) :]
    return head, int(tail) if tail else -1
