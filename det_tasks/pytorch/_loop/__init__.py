"""The training loop and what runs inside it: validation, training metrics, checkpoint
writing and restoring, warm start, the profiler and TensorBoard."""

__all__: list[str] = []
