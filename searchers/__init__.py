"""Searchers that other packages plug into ``det_tasks.searcher`` (entry point group
``det_tasks.searchers``): Optuna's model-based search (``searcher.name: optuna``). They need
neither Prefect nor Dask, so ``det-tasks run`` and the flows share them."""

__all__: list[str] = []
