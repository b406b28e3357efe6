"""MLflow and S3: the metrics sink, the checkpoint store, GC, model registry and URI resolution.

The only package that imports mlflow and boto3; det_tasks reaches it only through the
MetricsSink / CheckpointStore interfaces and the checkpoint-resolver entry points.
"""

__all__: list[str] = []
