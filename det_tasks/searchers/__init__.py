"""Hyperparameter searchers, as pure logic: the built-in ones (``base``: single and grid,
``random_search``, ``asha``), the one a config names (``choose``), and plug-ins added by
name through the ``det_tasks.searchers`` entry points (Optuna's, ``optuna``, is one; the
config reads their names and fields through ``det_tasks.config.searcher_plugins``). They
need neither Prefect nor Dask, so ``det-tasks run`` and the flows share them."""

__all__: list[str] = []
