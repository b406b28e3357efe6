"""Determined's launch layers in an entrypoint: ``python3 -m determined.launch.torch_distributed
[OVERRIDES... --] python3 train.py`` (or ``--trial model_def:Trial``), and ``...launch.horovod``.

Determined wrapped the script in torchrun or horovodrun with one process per slot; here the
same entrypoint runs on det_tasks' launcher (``det_tasks.runner.worker_group``) with
``resources.slots_per_trial`` processes, the named backend, and the overrides passed through
to torchrun/horovodrun after ours (so they win, as Determined's did). DeepSpeed's and
TensorFlow's launch layers are refused with what to use instead.
"""

from __future__ import annotations

import dataclasses
import shlex

from det_tasks.errors import ConfigError

__all__ = ["LaunchLayer", "parse_launch_layer"]

_BACKENDS = {
    "torch_distributed": "torch",
    "horovod": "horovod",
    "autohorovod": "horovod",
}
_REFUSED = {
    "deepspeed": (
        "DeepSpeed is not supported by det_tasks (no DeepSpeedTrial, no deepspeed launcher): "
        "port the model to PyTorchTrial or a Trainer-API script and launch it with "
        "`python3 -m determined.launch.torch_distributed python3 train.py` (DDP through "
        "context.wrap_model) or `determined.launch.horovod`"
    ),
    "tensorflow": (
        "TensorFlow/Keras trials are not supported by det_tasks: it runs PyTorch code; use "
        "`python3 -m determined.launch.torch_distributed python3 train.py`"
    ),
}
_REFUSED["autodeepspeed"] = _REFUSED["deepspeed"]


@dataclasses.dataclass(frozen=True)
class LaunchLayer:
    """What an entrypoint asks for: a backend (None = no launch layer), the launcher
    overrides, and either a script command or a legacy ``--trial`` class."""

    backend: str | None
    overrides: tuple[str, ...]
    script: tuple[str, ...]
    trial: str | None = None
    module: str | None = None


def parse_launch_layer(entrypoint: str | list[str]) -> LaunchLayer:
    """Split a launch-layer prefix off ``entrypoint``; no prefix gives backend None."""
    argv = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    rest = _after_module_flag(argv)
    if rest is None or not rest[0].startswith("determined.launch"):
        return LaunchLayer(backend=None, overrides=(), script=tuple(argv))
    module = rest[0]
    name = module.removeprefix("determined.launch").lstrip(".")
    shown = " ".join(argv)
    if name in _REFUSED:
        raise ConfigError(f"entrypoint {shown!r}: {_REFUSED[name]}")
    if name not in _BACKENDS:
        raise ConfigError(
            f"entrypoint {shown!r}: launch layer {module!r} is not supported; det_tasks runs "
            "determined.launch.torch_distributed and determined.launch.horovod (with "
            "resources.slots_per_trial processes)"
        )
    args = rest[1:]
    overrides: list[str] = []
    if "--" in args:
        split = args.index("--")
        overrides, args = args[:split], args[split + 1 :]
    if args[:1] == ["--autohorovod"]:
        args = args[1:]
    trial = None
    if args[:1] == ["--trial"] or (args and args[0].startswith("--trial=")):
        trial = args[1] if args[0] == "--trial" and len(args) > 1 else args[0][8:]
        extra = args[2:] if args[0] == "--trial" else args[1:]
        if not trial or extra:
            raise ConfigError(
                f"entrypoint {shown!r}: `--trial` takes one `module:TrialClass` and nothing "
                "after it"
            )
        args = []
    elif not args:
        raise ConfigError(
            f"entrypoint {shown!r}: nothing to launch; name the script after the launch layer, "
            f"e.g. `python3 -m {module} python3 train.py`, or `--trial model_def:Trial`"
        )
    return LaunchLayer(
        backend=_BACKENDS[name],
        overrides=tuple(overrides),
        script=tuple(args),
        trial=trial,
        module=module,
    )


def _after_module_flag(argv: list[str]) -> list[str] | None:
    """``python3 -m MOD ARGS`` -> [MOD, *ARGS]; anything else -> None."""
    if len(argv) >= 3 and argv[0].rsplit("/", 1)[-1].startswith("python") and argv[1] == "-m":
        return argv[2:]
    return None
