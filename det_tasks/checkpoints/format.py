"""The checkpoint directory format, compatible with Determined's.

Layout: ``state_dict.pth`` (models/optimizers/lr_schedulers/callbacks/rng_state/scaler and
our ``trial_state``), ``load_data.json`` (trial class spec, hparams, config), ``code/``
(the model directory) and ``metadata.json`` (format version plus a sha256 manifest,
written last, so a checkpoint without it is incomplete). Loading uses
``weights_only=True`` with the numpy types Determined's RNG state needs allow-listed.

torch is imported by the functions that use it: the experiment flow reaches this module
(checkpoint records, code copies, manifests) and runs no torch code.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from det_tasks.checkpoints.code_selection import MAX_MODEL_DEF_BYTES
from det_tasks.checkpoints.safe_unpickle import load_pickle, torch_safe_globals
from det_tasks.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_VERSION",
    "LOAD_DATA_FILE",
    "METADATA_FILE",
    "STATE_FILE",
    "capture_rng_state",
    "copy_code",
    "determined_progress",
    "find_state_file",
    "read_json",
    "read_state",
    "restore_rng_state",
    "seal",
    "verify",
    "write_json",
]

FORMAT_VERSION = 1
STATE_FILE = "state_dict.pth"
LOAD_DATA_FILE = "load_data.json"
METADATA_FILE = "metadata.json"
CODE_DIR = "code"
MAX_CODE_BYTES = MAX_MODEL_DEF_BYTES  # Determined's, as for a package
_LEGACY_STATE_PATHS = [
    (STATE_FILE,),
    ("determined", STATE_FILE),
    ("pedl", STATE_FILE),
    ("checkpoint.pt",),
]
_SKIP_CODE = {".git", "__pycache__", ".venv", "checkpoints", ".mypy_cache", ".pytest_cache"}


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA) RNG states, in weights_only-loadable types."""
    import torch

    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    assert isinstance(keys, np.ndarray)
    state: dict[str, Any] = {
        "cpu_rng_state": torch.random.get_rng_state(),
        "np_rng_state": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "random_rng_state": random.getstate(),
    }
    if device.type == "cuda":
        state["gpu_rng_state"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    import torch

    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy()
    np.random.set_state((name, np.asarray(keys).astype(np.uint32), pos, has_gauss, cached))
    random.setstate(_as_tuple(state["random_rng_state"]))
    torch.random.set_rng_state(state["cpu_rng_state"])
    if device.type == "cuda" and "gpu_rng_state" in state:
        torch.cuda.set_rng_state(state["gpu_rng_state"], device)


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


def find_state_file(path: Path) -> Path:
    """The state file of a checkpoint, in any layout Determined ever wrote."""
    for parts in _LEGACY_STATE_PATHS:
        candidate = path.joinpath(*parts)
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"checkpoint directory {str(path)!r} has no {STATE_FILE}: it is incomplete or not a "
        "PyTorchTrial checkpoint"
    )


def determined_progress(path: Path) -> dict[str, Any]:
    """How far a Determined-written checkpoint had trained, from whichever progress file
    its version wrote: ``trial_state.pkl`` (0.19+: ``batches_trained``),
    ``workload_sequencer.pkl`` (0.15-0.18: ``latest_batch``, earlier ``steps_completed`` or
    ``total_batches_processed``), else ``metadata.json``'s ``steps_completed``/``latest_batch``.
    Pickles are read through the allow-list of det_tasks.checkpoints.safe_unpickle."""
    for name, keys in (
        ("trial_state.pkl", ("batches_trained",)),
        ("workload_sequencer.pkl", ("latest_batch", "steps_completed", "total_batches_processed")),
    ):
        file = path / name
        if file.is_file():
            state = load_pickle(file)
            if not isinstance(state, dict):
                raise CheckpointError(f"{str(file)!r} does not hold a dict")
            batches = next((state[k] for k in keys if state.get(k) is not None), None)
            if batches is None:
                raise CheckpointError(f"{str(file)!r} records none of {', '.join(keys)}")
            return {"batches_trained": int(batches)}
    meta = path / METADATA_FILE
    data = read_json(meta) if meta.exists() else {}
    steps = (
        data.get("steps_completed", data.get("latest_batch", 0)) if isinstance(data, dict) else 0
    )
    return {"batches_trained": int(steps or 0)}


def read_state(path: Path, torch_load_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``state_dict.pth`` safely (weights_only unless the caller overrides it)."""
    import torch

    state_file = find_state_file(path)
    kwargs = {"map_location": "cpu", "weights_only": True, **(torch_load_kwargs or {})}
    try:
        if kwargs["weights_only"]:
            with torch.serialization.safe_globals(torch_safe_globals()):
                state = torch.load(str(state_file), **kwargs)
        else:
            state = torch.load(str(state_file), **kwargs)
    except Exception as err:  # torch raises many types for bad files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = ""
        if "Weights only load failed" in str(err) or "Unsupported global" in str(err):
            hint = (
                "; it holds Python objects that weights_only loading refuses. If you trust "
                "this checkpoint, pass torch_load_kwargs={'weights_only': False}"
            )
        raise CheckpointError(
            f"cannot read checkpoint file {str(state_file)!r}: {first}{hint}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(state_file)!r} does not hold a state dict")
    return state


def write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=_json_value)


def _json_value(value: Any) -> Any:
    """numpy and torch numbers as the Python numbers they hold (NaN and infinity are
    written as JSON's NaN/Infinity and read back as floats); anything else as its str."""
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return value.tolist()
    return str(value)


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {str(path)!r} is unreadable: {err}") from None


def copy_code(model_dir: Path, dest: Path, excluded_dirs: Sequence[Path] = ()) -> None:
    """Copy the model definition into ``dest/code`` (as Determined did): the rules of
    det_tasks.checkpoints.code_selection (``.detignore``, no credentials, no platform home,
    database, cache or checkpoint), refused over Determined's limit. A file that vanishes
    during the copy is skipped.

    The folder ``dest`` is staged in (the store's) is left out wherever it is inside the
    model directory, with ``excluded_dirs`` (the config's checkpoint folders,
    ``det_tasks.config.storage_paths.code_exclusions``): else each checkpoint's copy
    holds every checkpoint before it."""
    from det_tasks.checkpoints.code_selection import model_files, over_limit, sized

    store_root = dest.resolve().parent
    if store_root == model_dir.resolve():
        raise CheckpointError(
            f"checkpoints are written into the model directory {str(model_dir)!r} itself: "
            "each one would copy the ones before it; point checkpoint_storage at a "
            "subfolder such as ./checkpoints"
        )
    excluded = [*excluded_dirs, store_root, dest]
    files = sized(model_files(model_dir, [f"{d}/" for d in _SKIP_CODE], excluded))
    refusal = over_limit(model_dir, files, MAX_CODE_BYTES)
    if refusal:
        raise CheckpointError(refusal)
    code = dest / CODE_DIR
    code.mkdir(exist_ok=True)
    for rel, path, _ in files:
        target = code / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(path, target)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue  # gone since it was listed (a staging folder, a journal)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel == METADATA_FILE:
            continue
        files[rel] = {"size": file.stat().st_size, "sha256": _sha256(file)}
    return files


def seal(path: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """Write metadata.json with the format version and a checksum of every file, last."""
    from det_tasks.checkpoints.trust import sign_manifest

    files = _manifest(path)
    sealed = {
        **metadata,
        "format_version": FORMAT_VERSION,
        "files": files,
        "signature": sign_manifest(files),
    }
    write_json(path / METADATA_FILE, sealed)
    return sealed


def verify(path: Path) -> dict[str, Any]:
    """Check every file against metadata.json; a Determined checkpoint has no manifest."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    meta_path = path / METADATA_FILE
    if not meta_path.exists():
        find_state_file(path)
        return {}
    metadata = read_json(meta_path)
    version = metadata.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(meta_path)!r} has format_version {version}; this det_tasks reads up to "
            f"{FORMAT_VERSION}: upgrade det_tasks"
        )
    for rel, expected in (metadata.get("files") or {}).items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing (listed in metadata)")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is truncated or corrupted: {size} bytes, "
                f"metadata.json says {expected['size']}"
            )
        digest = _sha256(file)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is corrupted: sha256 {digest[:12]}... does "
                f"not match {expected['sha256'][:12]}... in metadata.json"
            )
    return dict(metadata)
