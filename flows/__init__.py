"""Prefect flows and tasks: experiments as train/validate/checkpoint DAGs of Prefect tasks,
batch inference, and the experiment verbs the ``det`` command calls (pause, activate,
cancel, kill, start a deployment run, read its logs).

The only package that imports ``prefect`` (import-linter checks it). Its tasks run their
work on the Dask runtime (``cluster``: every step goes through ``cluster.steps``) and record
it through ``registry``; the trial itself is ``det_tasks``.
"""

__all__: list[str] = []
