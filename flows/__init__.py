"""Prefect flows and tasks: experiments as train/validate/checkpoint DAGs of Prefect tasks,
batch inference, and the experiment verbs the ``det`` command calls (pause, activate,
cancel, kill, start a deployment run, read its logs).

Of the platform's packages, the only one that imports ``prefect`` (import-linter checks
it; ``bench`` times it directly). Its tasks run their work on the Dask runtime
(``cluster``: every step goes through ``cluster.steps``) and record it through
``registry``; the trial itself is ``det_tasks``.
"""

import os

# Prefect prints a telemetry notice on its first import in a terminal (a new user's first
# `det experiment create` or `python -m flows.experiment`): the standard opt-out, set here,
# before any of this package imports Prefect, unless the user set it either way.
os.environ.setdefault("DO_NOT_TRACK", "1")

__all__: list[str] = []
