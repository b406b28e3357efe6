"""``python -m flows.experiment``'s command line, checked before anything starts: the
config and its overrides, ``--activate KEY`` or ``--continue KEY``, and
``--use-changed-code``. Light on purpose: it runs before the flow's heavy imports."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

__all__ = ["CommandLine", "check_command_line", "split_flag"]


def split_flag(args: list[str], flag: str = "--activate") -> tuple[list[str], str | None]:
    """``CONFIG [key=value ...]`` without ``--activate KEY`` (or ``flag KEY``), and KEY
    (ValueError: no KEY)."""
    args = list(args)
    if flag not in args:
        return args, None
    at = args.index(flag)
    if at + 1 >= len(args):
        raise ValueError(f"{flag} needs the experiment key it printed")
    key = args.pop(at + 1)
    args.pop(at)
    return args, key


@dataclasses.dataclass(frozen=True)
class CommandLine:
    """``python -m flows.experiment``'s arguments, checked: the config, its overrides, the
    key to activate, and the validated config (entrypoint importable)."""

    config: str  # as typed
    overrides: list[str]
    experiment_key: str | None
    cfg: Any  # det_tasks.config.ExperimentConfig
    use_changed_code: bool = False  # resume with the folder's code, not the snapshot


def check_command_line(args: list[str]) -> CommandLine:
    """Validate before anything starts (DetTasksError or ValueError, in the user's words)."""
    from det_tasks.config.entered import enter_file
    from det_tasks.runner.in_process import check_entrypoint

    args, key = split_flag(args)
    args, continued = split_flag(args, "--continue")
    if key is not None and continued is not None:
        raise ValueError("give --activate KEY or --continue KEY, not both")
    use_changed = "--use-changed-code" in args
    args = [a for a in args if a != "--use-changed-code"]
    if use_changed and key is None and continued is None:
        raise ValueError(
            "--use-changed-code resumes a paused experiment with its folder's changed code: "
            "give it with --activate KEY (a new experiment runs the folder as it is)"
        )
    config_path = Path(args[0]).resolve()
    raw, cfg = enter_file(config_path, args[1:])
    if use_changed or (key is None and continued is None):  # else the flow checks its snapshot
        check_entrypoint(cfg, config_path.parent)
    if continued is not None:  # Determined's continue: back to PAUSED, then activated
        from registry.experiments.continuation import continue_in_store

        print(continue_in_store(cfg.name or config_path.stem, continued, raw, cfg), file=sys.stderr)
        key = continued
    elif key is not None:  # only an experiment that stopped short continues
        from registry.experiments.activation import check_activation

        check_activation(cfg.name or config_path.stem, key)
    return CommandLine(args[0], args[1:], key, cfg, use_changed)
