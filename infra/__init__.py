"""Starting, stopping and configuring the real services: the local stack (Prefect server and
worker, Dask scheduler and workers, MLflow, SeaweedFS, PostgreSQL), a home's warm services,
the deployments, and the Docker and Kubernetes work-pool templates. The top layer beside
``det_cli``: it may import every package below it (``cluster.devices`` for the GPUs)."""

__all__: list[str] = []
