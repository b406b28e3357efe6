"""Names the tracking store must accept: checked when the config is validated, so a name
MLflow refuses fails before training instead of after it.

det_tasks does not import mlflow; the rules below are MLflow 3.17.2's, copied from
``mlflow/utils/validation.py`` (``_validate_experiment_name``, ``_validate_param_name``,
``validate_param_and_metric_name``, ``path_not_unique``, ``MAX_EXPERIMENT_NAME_LENGTH``,
``MAX_ENTITY_KEY_LENGTH``). Keep them in step when MLflow is upgraded.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata

__all__ = [
    "MAX_EXPERIMENT_NAME_LENGTH",
    "MAX_PARAM_KEY_LENGTH",
    "PARAM_KEY_PREFIX",
    "experiment_name_problem",
    "param_key_problem",
]

# mlflow/utils/validation.py: MAX_EXPERIMENT_NAME_LENGTH.
MAX_EXPERIMENT_NAME_LENGTH = 500
# mlflow/utils/validation.py: MAX_ENTITY_KEY_LENGTH (param, metric and tag keys).
MAX_PARAM_KEY_LENGTH = 250
# A trial run logs hyperparameter ``a.b`` as the MLflow param ``hp.a.b``
# (registry/runs/tracking.py).
PARAM_KEY_PREFIX = "hp."
# mlflow/utils/validation.py: validate_param_and_metric_name, off Windows (which also
# refuses ':'): alphanumerics (Unicode word characters), '_', '-', '.', ' ', ':' and '/'.
_PARAM_KEY = re.compile(r"^[/\w.\- :]*$")


def experiment_name_problem(name: str) -> str | None:
    """Why MLflow would refuse ``name`` as an experiment's name, or why it holds a control
    character (NUL, which PostgreSQL refuses in text; tab, newline..., which break log
    lines and one-line names in the UIs), or None. Folders named after an experiment go
    through ``det_tasks.folder_names``, so length and slashes are MLflow's business only."""
    if not name.strip():
        return "it is empty; give the experiment a name, or leave `name` out to use the file's"
    if len(name) > MAX_EXPERIMENT_NAME_LENGTH:
        return (
            f"it is {len(name)} characters; MLflow refuses experiment names over "
            f"{MAX_EXPERIMENT_NAME_LENGTH}: shorten it"
        )
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        return f"it holds the control character {control!r}: remove it"
    return None


def param_key_problem(key: str) -> str | None:
    """Why MLflow would refuse ``key`` as a param key (``_validate_param_name`` and the
    length limit of ``_validate_param``), or None."""
    if not _PARAM_KEY.match(key):
        bad = next(c for c in key if not _PARAM_KEY.match(c))
        return (
            f"MLflow refuses param key {_shown(key)} ({bad!r} is not allowed): names may hold only "
            "letters, digits, '_', '-', '.', ' ', ':' and '/'"
        )
    norm = posixpath.normpath(key)
    if norm != key or norm == "." or norm.startswith(("..", "/")):
        return (
            f"MLflow refuses param key {_shown(key)}: as a path it would read {norm!r} (no '//', "
            "'./', '../' or trailing '/')"
        )
    if len(key) > MAX_PARAM_KEY_LENGTH:
        return (
            f"MLflow refuses param key {_shown(key)} ({len(key)} characters, over its "
            f"{MAX_PARAM_KEY_LENGTH}): shorten the name"
        )
    return None


def _shown(key: str) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."
