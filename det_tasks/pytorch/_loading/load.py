"""``load_trial_from_checkpoint_path``: a trained trial back from a checkpoint, for inference.

Works on our checkpoints and on Determined's (same layout); loading is weights_only
unless the caller overrides it, and our checkpoints are checksum-verified first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from det_tasks import plugins
from det_tasks.checkpoints import format as ckpt
from det_tasks.checkpoints.references import open_checkpoint_uri, scheme_of
from det_tasks.checkpoints.trial_class import read_load_data, trial_class_spec
from det_tasks.checkpoints.trust import is_signed_here, trusted_schemes
from det_tasks.errors import CheckpointError
from det_tasks.pytorch._api.context import (
    PyTorchExperimentalContext,
    PyTorchTrialContext,
    TrialSettings,
)
from det_tasks.pytorch._api.legacy import adapt_trial
from det_tasks.pytorch._loading.legacy_load import bare_model_of

__all__ = ["CheckpointLoadContext", "check_code_trusted", "load_trial_from_checkpoint_path"]


class CheckpointLoadContext(PyTorchTrialContext):
    """The context a trial gets when rebuilt from a checkpoint: no training loop behind it,
    so the wrap calls only register (and move models to the device): no data-parallel
    wrapper, no Horovod optimizer, no autocast from use_amp()/configure_apex_amp()."""

    def __init__(self, settings: TrialSettings) -> None:
        super().__init__(dataclasses.replace(settings, managed_training=False))
        self.experimental = _LoadExperimentalContext(self)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"wrap_model takes a torch.nn.Module, got {type(model).__name__}")
        model = model.to(self.device)
        self.models.append(model)
        return model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
    ) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"wrap_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizers.append(optimizer)
        return optimizer

    def configure_apex_amp(self, models: Any, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        return models, optimizers


class _LoadExperimentalContext(PyTorchExperimentalContext):
    def use_amp(self) -> None:
        """Inference from a checkpoint runs the model as written: no autocast, no scaler."""


# Entry points run before a checkpoint's code is imported (pyproject.toml names
# det_tasks.compat:install, which serves ``import determined``).
IMPORT_LAYERS = "det_tasks.import_layers"


def load_trial_from_checkpoint_path(
    path: str | Path,
    trial_class: type | None = None,
    trial_kwargs: dict[str, Any] | None = None,
    torch_load_kwargs: dict[str, Any] | None = None,
    hparams: dict[str, Any] | None = None,
    trust_code: bool = False,
    *,
    prepare_imports: Callable[[], object] | None = None,
) -> Any:
    """Rebuild the trial (models restored, in eval mode) from a checkpoint directory or URI;
    a ``build_model()`` trial (pre-0.13) comes back as that bare module, as in Determined.

    ``trial_class`` defaults to the class recorded in ``load_data.json``, imported from the
    checkpoint's ``code/``; ``hparams`` default to the ones the checkpoint was trained with.
    Importing that code runs it, so it needs a checkpoint this installation wrote, a
    ``runs:/``/``models:/`` reference (the allow-listed registry), or ``trust_code=True``
    (det_tasks.checkpoints.trust). ``prepare_imports`` runs just before that code is imported:
    ``det_tasks.compat``'s install step, so code importing ``determined`` finds it (this
    package never imports the compatibility layer, which is built from it)."""
    with open_checkpoint_uri(str(path)) as directory:
        metadata = ckpt.verify(directory)
        load_data = read_load_data(directory)
        state = ckpt.read_state(directory, torch_load_kwargs)
        if trial_class is None:
            consent = trust_code or _weights_only_off(torch_load_kwargs)
            check_code_trusted(str(path), directory, metadata, consent)
            if not trust_code and not _code_trusted(str(path), directory, metadata):
                warnings.warn(
                    f"load_trial_from_checkpoint_path({str(path)!r}): weights_only=False "
                    f"trusts the checkpoint, so its code runs: importing "
                    f"{trial_class_spec(directory, load_data)} from its code/",
                    UserWarning,
                    stacklevel=2,
                )
            if prepare_imports is None:  # the installed layer (det_tasks.compat), found
                # through its entry point: this package never imports it (it is built from
                # this one), yet Determined's own code loads here unchanged
                prepare_imports = plugins.load_one(IMPORT_LAYERS, "determined")
            if prepare_imports is not None:
                prepare_imports()
            trial_class = _import_trial_class(directory, load_data)
        device = _device_of(torch_load_kwargs)
        settings = TrialSettings(
            hparams=dict(hparams if hparams is not None else load_data.get("hparams") or {}),
            exp_conf=load_data.get("experiment_config"),
            device=str(device),
        )
        context = CheckpointLoadContext(settings)
        trial = trial_class(context, **(trial_kwargs or {}))
        if (bare := bare_model_of(trial, state, context.device)) is not None:
            return bare
        trial = adapt_trial(trial, context)
        from det_tasks.pytorch._loop.restore import load_state

        rng_free = {k: v for k, v in state.items() if k != "rng_state"}
        load_state(context, {}, rng_free)
        for model in context.models:
            model.eval()
        return trial


def _device_of(torch_load_kwargs: dict[str, Any] | None) -> torch.device:
    location = (torch_load_kwargs or {}).get("map_location", "cpu")
    if isinstance(location, str | torch.device):
        return torch.device(location)
    return torch.device("cpu")


def _weights_only_off(torch_load_kwargs: dict[str, Any] | None) -> bool:
    """``weights_only=False``, what Determined's own checkpoint-loading test passes: the
    caller already lets the checkpoint's pickles run code, so its trial class may run too."""
    return (torch_load_kwargs or {}).get("weights_only", True) is False


def _code_trusted(reference: str, directory: Path, metadata: dict[str, Any]) -> bool:
    """Written (signed) by this installation, or reached through the allow-listed registry."""
    return scheme_of(reference) in trusted_schemes() or is_signed_here(directory, metadata)


def check_code_trusted(
    reference: str, directory: Path, metadata: dict[str, Any], trust_code: bool
) -> None:
    """Refuse to import a checkpoint's ``code/`` unless it may run here (signed by this
    installation, from an allow-listed registry scheme, or ``trust_code``): batch inference
    asks the same before it imports a checkpoint's dataset code."""
    if trust_code or _code_trusted(reference, directory, metadata):
        return
    raise CheckpointError(
        f"checkpoint {reference!r} was not written by this installation (its manifest carries "
        "no valid signature), and rebuilding its trial class would run the Python in its "
        "code/. Pass trust_code=True if you trust where it came from, or trial_class=YourTrial "
        "to use your own code (weights are loaded weights_only unless torch_load_kwargs says "
        "weights_only=False, which trusts the code as well)"
    )


def _import_trial_class(directory: Path, load_data: dict[str, Any]) -> type:
    spec = trial_class_spec(directory, load_data)
    module_name, _, qualname = spec.partition(":")
    code = directory / "code"
    with (
        _on_sys_path(code if code.is_dir() else None),
        _fresh_modules(module_name, code),
        _no_bytecode(),
    ):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != "determined":
                raise CheckpointError(
                    f"cannot import trial module {module_name!r} recorded in the checkpoint: "
                    f"{err}; pass trial_class=YourTrial"
                ) from None
            raise CheckpointError(
                f"the checkpoint's trial module {module_name!r} imports `determined`, which "
                "is not installed here: load it with "
                "det_tasks.compat.load_trial_from_checkpoint_path (it serves `determined` "
                "from det_tasks), or pass trial_class=YourTrial"
            ) from None
        except ImportError as err:
            raise CheckpointError(
                f"cannot import trial module {module_name!r} recorded in the checkpoint: "
                f"{err}; pass trial_class=YourTrial"
            ) from None
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise CheckpointError(
                f"module {module_name!r} has no {qualname!r}; pass trial_class=YourTrial"
            )
    return obj  # type: ignore[no-any-return]


@contextlib.contextmanager
def _fresh_modules(module_name: str, code: Path) -> Iterator[None]:
    """Import the checkpoint's own ``model_def``, not a same-named module this process
    imported from elsewhere; the process's modules are put back afterwards."""
    if not code.is_dir():
        yield
        return
    top = module_name.split(".")[0]
    root = str(code.resolve())
    shadowing = {
        name: mod
        for name, mod in list(sys.modules.items())
        if (name == top or name.startswith(top + "."))
        and not str(getattr(mod, "__file__", "") or "").startswith(root)
    }
    for name in shadowing:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(shadowing)


@contextlib.contextmanager
def _no_bytecode() -> Iterator[None]:
    """Importing from a checkpoint must not write __pycache__ into it."""
    saved = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = saved


@contextlib.contextmanager
def _on_sys_path(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    sys.path.insert(0, str(path))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(path))
