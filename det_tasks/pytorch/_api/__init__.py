"""What trial code touches: ``PyTorchTrial`` and its context, callbacks, LR schedulers,
reducers, mixed precision, data-parallel wrapping, the pre-0.13 interface and the Trainer
proposal's calls."""

__all__: list[str] = []
