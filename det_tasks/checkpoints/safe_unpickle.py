"""Reading the pickles Determined wrote (0.13 to 0.38) without running arbitrary code.

Determined saved ``state_dict.pth`` with a plain ``torch.save`` (numpy's RNG state inside,
pickled by numpy 1.x as ``numpy.core.multiarray._reconstruct``) and its progress in
``workload_sequencer.pkl`` / ``trial_state.pkl`` with a plain ``pickle.dump``; Determined
itself read them back with a plain ``pickle.load``, which runs whatever a file names.
Here every global a pickle may name is on an allow-list of the data types Determined
wrote: numpy arrays, dtypes and scalars (under both numpy 1's and numpy 2's module
names), ``collections.OrderedDict`` and a few inert builtins. Anything else is refused
with the name of the type, so a tampered file cannot execute code.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from det_tasks.errors import CheckpointError

__all__ = ["allowed_globals", "load_pickle", "torch_safe_globals"]

MAX_PICKLE_BYTES = 16 * 1024 * 1024  # progress files are a few hundred bytes


def _numpy_globals() -> dict[str, Any]:
    core = getattr(np, "_core", None) or np.core
    multiarray = core.multiarray
    found: dict[str, Any] = {}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found[f"{module}._reconstruct"] = multiarray._reconstruct
        found[f"{module}.scalar"] = multiarray.scalar
    for module in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray"):
        found[f"{module}.ndarray"] = np.ndarray
        found[f"{module}.dtype"] = np.dtype
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            found[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    return found


_INERT_BUILTINS = {
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "builtins.range": range,
    "builtins.bytearray": bytearray,
    "collections.OrderedDict": collections.OrderedDict,
    # Python 2 era pickles name builtins under their old module.
    "__builtin__.set": set,
    "__builtin__.frozenset": frozenset,
}


def allowed_globals() -> dict[str, Any]:
    """Every global (``module.name``) a Determined-written pickle may reference."""
    return {**_INERT_BUILTINS, **_numpy_globals()}


def torch_safe_globals() -> list[Any]:
    """The allow-list in the form ``torch.serialization.safe_globals`` takes: each object
    paired with the name it is pickled under (numpy 1's names differ from numpy 2's)."""
    return [(obj, name) for name, obj in allowed_globals().items()]


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source
        self._allowed = allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise CheckpointError(
                f"{self._source} references {module}.{name}, which is not one of the data "
                "types Determined wrote; it is refused because unpickling it could run code. "
                "If you trust this file, load it yourself with pickle"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source} uses persistent ids; it is not a plain pickle")


def load_pickle(path: Path) -> Any:
    """Read a small pickle file Determined wrote, through the allow-list."""
    size = path.stat().st_size
    if size > MAX_PICKLE_BYTES:
        raise CheckpointError(
            f"{str(path)!r} is {size} bytes; Determined's progress pickles are tiny"
        )
    data = path.read_bytes()
    try:
        return _RestrictedUnpickler(io.BytesIO(data), repr(str(path))).load()
    except CheckpointError:
        raise
    except Exception as err:  # pickle raises many types for damaged input
        raise CheckpointError(f"{str(path)!r} is not a readable pickle: {err}") from None
