"""Optuna's model-based search as a plug-in searcher (``searcher.name: optuna``), registered
by this project's ``pyproject.toml``; optuna is imported only when such an experiment runs."""

__all__: list[str] = []
