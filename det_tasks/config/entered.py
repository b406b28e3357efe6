"""The experiment config as it entered the platform: read, overridden and validated once,
where it enters (``det experiment create`` / ``continue``, the experiment flow's
command line or deployment parameters, ``det-tasks run``), and carried from there as this
one object to every trial, segment and slot.

Downstream nothing re-reads the file or re-validates: deprecations and unhonoured-field
warnings are the entry's alone, once. A held trial gets the object inside its ``TrialSpec``
(pickled by Dask); a ``det-tasks run`` process (a script or multi-slot segment, each rank of
a worker group) gets it as a file (``write`` / ``read``): the same pickle. Pickling a pydantic
model keeps its validated fields as they are, so reading it back builds no model.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from det_tasks.config.experiment import ExperimentConfig
from det_tasks.config.loader import overridden_config, parse_yaml_text, read_config_file
from det_tasks.errors import ConfigError

__all__ = ["ENTERED_CONFIG_FLAG", "EnteredConfig", "enter_file", "enter_text"]

# ``det-tasks run``'s (hidden) flag naming the file an entered config was written to: its
# starter (a flow's segment, a worker group's launcher) entered it already.
ENTERED_CONFIG_FLAG = "--entered-config"


@dataclasses.dataclass(frozen=True, eq=False)
class EnteredConfig:
    """The user's mapping with every override applied (what a trial's
    ``get_experiment_config()`` shows over the defaults) and its validated form.
    ``raw, config = entered`` unpacks both; each read of ``raw`` is a fresh copy, so no
    reader can change what the next one sees."""

    _raw: dict[str, Any]
    config: ExperimentConfig

    @property
    def raw(self) -> dict[str, Any]:
        return copy.deepcopy(self._raw)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.raw, self.config))

    def write(self, path: Path) -> Path:
        """This config as a file a ``det-tasks run`` process reads back (``read``)."""
        path.write_bytes(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))
        return path

    @staticmethod
    def read(path: Path) -> EnteredConfig:
        """The config ``write`` wrote, as it was validated (no file parse, no model build)."""
        try:
            entered = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
            raise ConfigError(f"entered config {str(path)!r} cannot be read: {err}") from None
        if not isinstance(entered, EnteredConfig):
            raise ConfigError(f"{str(path)!r} holds no entered experiment config")
        return entered


_ENTERED: dict[tuple[str, tuple[str, ...], int, int], EnteredConfig] = {}


def enter_file(path: Path, overrides: list[str] | None) -> EnteredConfig:
    """The config file with ``overrides``, read and validated; once per process: asked again
    for the same unchanged file and overrides (the flow's command-line check, then the flow;
    ``det-tasks run``'s slot check, then its trial) it gives the same object, warning once."""
    try:
        stat = path.stat()
    except OSError:
        stat = None
    key = (str(path.resolve()), tuple(overrides or ()), *(_stamp(stat)))
    if key not in _ENTERED:
        raw, config = overridden_config(read_config_file(path), overrides, str(path))
        _ENTERED.clear()  # a process enters one experiment: keep only the latest
        _ENTERED[key] = EnteredConfig(raw, config)
    return _ENTERED[key]


def _stamp(stat: Any) -> tuple[int, int]:
    return (stat.st_mtime_ns, stat.st_size) if stat is not None else (-1, -1)


def enter_text(text: str, source: str, overrides: list[str] | None) -> EnteredConfig:
    """A config's text (``source`` names it in messages) with ``overrides``, validated."""
    raw, config = overridden_config(parse_yaml_text(text, source), overrides, source)
    return EnteredConfig(raw, config)
