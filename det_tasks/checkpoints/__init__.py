"""Checkpoints: the directory format, where the bytes go, what is kept, and what may run.

``format`` (the Determined-compatible layout, its manifest and RNG state), ``store`` (the
``CheckpointStore`` interface and a local-directory store), ``retention`` (keep the latest N
and best M), ``references`` (paths and ``scheme://`` references to directories, through
resolvers other packages register), ``trial_class`` (which trial class wrote one),
``trust`` (whose code may be imported), ``safe_unpickle`` (Determined's pickles without
running code) and ``model_package`` (a model directory as one reproducible archive).
Import the submodule you need; this package imports none of them.
"""

__all__: list[str] = []
