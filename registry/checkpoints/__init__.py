"""Checkpoints: the S3 store with its MLflow records, the local cache, ``s3://``/``runs:/``/
``models:/`` URIs, garbage collection, the model registry and importing Determined's."""

__all__: list[str] = []
