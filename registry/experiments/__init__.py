"""Experiments as ``det`` shows and steers them: what their trials did (``view``), their MLflow
experiment and saved view, the code they run (snapshots and packages), and which may be
activated or continued."""

__all__: list[str] = []
