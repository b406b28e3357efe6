"""MLflow and S3: the metrics sink, the checkpoint store, GC, model registry and URI resolution.

Sub-packages, each above the ones before it (an import-linter contract keeps the order):
``servers`` (reaching MLflow and S3), ``runs`` (experiments, runs and their tags),
``metrics`` (what a trial reports), ``checkpoints`` (the store, URIs, GC, models),
``experiments`` (what ``det`` shows and steers), ``jobs`` (the services a running trial,
script or batch job plugs into) and ``cli`` (the ``det-tasks`` subcommands).

Of the platform's packages, the one that talks to MLflow and S3 for trials and experiments
(``infra.seaweed`` also uses boto3, to create the local stack's bucket when it starts
SeaweedFS, declared in pyproject.toml's ``ignore_imports``; tests and benchmarks use both
directly). det_tasks never imports this package: it reaches it through the entry
points named in pyproject.toml (checkpoint resolvers, run services, unmanaged runs,
batch-job services, the trial-id resolver and ``det-tasks`` subcommands) and the
MetricsSink / CheckpointStore interfaces. ``registry.servers.shared_database`` (creating a
shared local database once, from this installation's template of its schema:
``database_templates``) serves the flows' Prefect database too.
"""

import os

# MLflow sends usage telemetry from every client process unless MLFLOW_DISABLE_TELEMETRY or
# DO_NOT_TRACK is "true" (flows sets DO_NOT_TRACK=1, Prefect's spelling, which MLflow does
# not read). Off, like the stack's Prefect analytics, before this package imports MLflow,
# unless the user set it either way.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

__all__: list[str] = []
