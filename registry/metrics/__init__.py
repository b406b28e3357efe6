"""What a trial reports, on its MLflow run: the exactly-once metrics sink and its backlog,
system metrics, the learning-curve plots and the TensorBoard files."""

__all__: list[str] = []
