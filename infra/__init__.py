"""Starting, stopping and configuring the real services (Prefect, MLflow, SeaweedFS, PostgreSQL)."""

__all__: list[str] = []
