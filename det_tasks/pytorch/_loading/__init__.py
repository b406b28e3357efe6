"""A trained trial back from a checkpoint (``load_trial_from_checkpoint_path``), including a
pre-0.13 trial's bare model."""

__all__: list[str] = []
