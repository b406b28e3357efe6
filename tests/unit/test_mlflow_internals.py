"""MLflow's private metric-name check, used in one place (registry.servers.mlflow_internals): these
known answers fail when MLflow renames it or changes what it refuses."""

from __future__ import annotations

from registry.servers.mlflow_internals import metric_name_problem


def test_mlflow_takes_determineds_usual_names() -> None:
    for name in ("training/loss", "validation/validation_loss", "train/lr-group_0", "a.b c:d"):
        assert metric_name_problem(name) is None, name


def test_mlflow_refuses_what_the_sink_cleans() -> None:
    problem = metric_name_problem("validation/recall@1")
    assert problem is not None and "Names may only contain alphanumerics" in problem
    for name in ("../escape", "/leading", "a//b"):
        assert metric_name_problem(name) is not None, name
