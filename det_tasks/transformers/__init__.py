"""Determined's ``determined.transformers``: ``DetCallback``, a Hugging Face
``TrainerCallback`` that reports a ``Trainer``'s metrics, checkpoints and progress through
a Core API context, and resumes and stops it as the platform asks. Needs the optional
``transformers`` extra."""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as err:  # one line saying what to install
    raise ImportError(
        "determined.transformers needs Hugging Face transformers: "
        "pip install -e '.[transformers]' (transformers==5.23.0 and accelerate)"
    ) from err

from det_tasks.transformers._callback import DetCallback, get_metric_type

__all__ = ["DetCallback", "get_metric_type"]
