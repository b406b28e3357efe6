"""Reading experiment YAML safely and turning validation failures into one-paragraph errors.

YAML is parsed with a size cap, an alias cap and a cap on the values the document expands
to: aliases re-use nodes, so 90 aliases nested 10 deep in a 1 KB file describe 9**10
values, which every walk of the config (validation, JSON dumps, MLflow params) expands.
Deprecated fields are translated with a warning; pydantic errors are rewritten to name the
field, the bad value and the fix.
"""

from __future__ import annotations

import copy
import difflib
import re
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from det_tasks.checkpoints.backends import options_model
from det_tasks.config.experiment import ExperimentConfig, SearcherConfig
from det_tasks.config.finite import FINITE_FIX, non_finite_field
from det_tasks.config.searcher_plugins import BUILT_IN_SEARCHERS, find_searcher_plugin
from det_tasks.config.unhonoured import warn_unhonoured
from det_tasks.errors import ConfigError

__all__ = [
    "apply_overrides",
    "describe_validation_error",
    "load_config",
    "overridden_config",
    "parse_config",
    "parse_with_overrides",
    "parse_yaml_text",
    "read_config_file",
    "read_config_text",
    "refuse_non_finite",
]

MAX_CONFIG_BYTES = 1_000_000
MAX_ALIASES = 100
# Values (scalars, lists, mappings, keys included) a document may expand to once every
# alias is replaced by what it names. A config within MAX_CONFIG_BYTES without aliases has
# fewer than 600,000 (each value takes at least one character and a separator), so only
# aliases that multiply reach this.
MAX_EXPANDED_NODES = 1_000_000


class _GuardedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents using more than MAX_ALIASES aliases, or expanding
    to more than MAX_EXPANDED_NODES values, before constructing any Python object."""

    alias_count = 0

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _refuse_expansion_bombs(node)
        return node

    def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            self.alias_count += 1
            if self.alias_count > MAX_ALIASES:
                raise ConfigError(
                    f"the config uses more than {MAX_ALIASES} YAML aliases (*name); "
                    "write the values out instead of referencing anchors"
                )
        return super().compose_node(parent, index)


def _refuse_expansion_bombs(root: yaml.Node) -> None:
    """Count the values ``root`` expands to, each shared node once (memoised, iterative:
    work in proportion to the file, not to the expansion); refuse past the cap or on an
    alias that contains itself."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes and not children_done:
            continue
        children = _children(node)
        if children_done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_EXPANDED_NODES:
                raise ConfigError(
                    f"its YAML aliases (*name) expand to more than {MAX_EXPANDED_NODES:,} "
                    "values (the limit); write the values out, or reference anchors fewer "
                    "times"
                )
            continue
        sizes[id(node)] = -1  # in progress: meeting it again below means a cycle
        stack.append((node, True))
        for child in children:
            if sizes.get(id(child)) == -1:
                raise ConfigError(
                    "a YAML alias (*name) refers to a value that contains it (a cycle); "
                    "write the value out instead"
                )
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def parse_yaml_text(text: str, source: str) -> Any:
    """Parse one YAML document; malformed input becomes a ConfigError naming the line."""
    if len(text.encode("utf-8", "replace")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_CONFIG_BYTES} bytes; is this a config?")
    try:
        return yaml.load(text, Loader=_GuardedLoader)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested too deeply") from None


def read_config_file(path: Path) -> Any:
    """The config file's YAML, parsed; a missing or unreadable file is a ConfigError naming it."""
    return parse_yaml_text(read_config_text(path), str(path))


def read_config_text(path: Path) -> str:
    """The config file's text; a missing or unreadable file is a ConfigError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override and validate an experiment config file."""
    path = Path(path)
    return parse_with_overrides(read_config_file(path), overrides, str(path))


def parse_with_overrides(raw: Any, overrides: list[str] | None, source: str) -> ExperimentConfig:
    """Validate ``raw`` with ``overrides`` applied. An error that the file alone does not
    have is blamed on the command line's override that brings it, not on the file the user
    did not change."""
    return overridden_config(raw, overrides, source)[1]


def overridden_config(
    raw: Any, overrides: list[str] | None, source: str
) -> tuple[Any, ExperimentConfig]:
    """``raw`` with ``overrides`` applied (each applied once), and its validated form, as
    ``parse_with_overrides`` validates it."""
    if not overrides:
        return raw, parse_config(raw, source=source)
    overridden = apply_overrides(raw, overrides)
    try:
        return overridden, parse_config(overridden, source=source)
    except ConfigError:
        culprit = _first_bad_override(raw, overrides, source)
        if culprit is None:
            raise
    return overridden, parse_config(overridden, source=f"command-line override {culprit!r}")


def _first_bad_override(raw: Any, overrides: list[str], source: str) -> str | None:
    """The first override that turns a valid ``raw`` invalid on its own, or None when the
    file itself is invalid (or only the overrides together are)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the real parse warns once
        try:
            parse_config(raw, source=source)
        except ConfigError:
            return None
        for item in overrides:
            try:
                parse_config(apply_overrides(raw, [item]), source=source)
            except ConfigError:
                return item
    return None


def apply_overrides(raw: Any, overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML) to a raw config."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a mapping before overrides can be applied")
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        node, parts = out, key.strip().split(".")
        while True:
            name, parts = _next_key(node, parts, item)
            if not parts:
                break
            child = node.get(name)
            if not isinstance(child, dict):
                child = {}
                node[name] = child
            node = child
        node[name] = parse_yaml_text(value, f"override {item!r}")
    return out


def _next_key(node: dict[str, Any], parts: list[str], item: str) -> tuple[str, list[str]]:
    """The key of ``node`` that ``parts`` names first, and the parts left after it. A name
    may hold dots itself (a hyperparameter ``model.hidden``): the longest dotted join of the
    parts that ``node`` has wins; one that could be read both ways is refused."""
    for n in range(len(parts), 1, -1):
        joined = ".".join(parts[:n])
        if joined in node:
            if parts[0] in node:
                raise ConfigError(
                    f"override {item!r} is ambiguous: the config has both {joined!r} and "
                    f"{parts[0]!r}; rename one of them"
                )
            return joined, parts[n:]
    return parts[0], parts[1:]


def parse_config(raw: Any, source: str = "config") -> ExperimentConfig:
    """Validate a raw mapping into an ExperimentConfig, or raise one clear ConfigError."""
    if not isinstance(raw, dict):
        kind = "empty" if raw is None else f"a {type(raw).__name__}"
        raise ConfigError(f"{source}: an experiment config must be a mapping, got {kind}")
    refuse_non_finite(raw, source)
    raw = _translate_deprecated(copy.deepcopy(raw), source)
    warn_unhonoured(raw, source)
    try:
        config = ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, raw, source)) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None
    _check_plugin_fields(config, raw, source)
    return config


def _check_plugin_fields(config: ExperimentConfig, raw: dict[str, Any], source: str) -> None:
    """A plug-in searcher's own fields, checked by its options model now, with the same
    one-line errors as the rest (its searcher is built only when the experiment runs)."""
    searcher = config.searcher
    if searcher.name in BUILT_IN_SEARCHERS:
        return
    options = find_searcher_plugin(searcher.name).options
    try:
        options.model_validate(searcher.plugin_fields)
    except ValidationError as err:
        raise ConfigError(
            describe_validation_error(
                err, raw, source, under=("searcher",), models=[options, SearcherConfig]
            )
        ) from None


def refuse_non_finite(raw: Any, source: str) -> None:
    """A ConfigError naming the first NaN or infinite value in ``raw`` (see config.finite)."""
    found = non_finite_field(raw)
    if found is not None:
        raise ConfigError(f"{source}: `{found[0]}` = {found[1]} is invalid: {FINITE_FIX}")


def _warn(source: str, message: str) -> None:
    warnings.warn(f"{source}: {message}", DeprecationWarning, stacklevel=3)


def _translate_deprecated(raw: dict[str, Any], source: str) -> dict[str, Any]:
    if "batches_per_step" in raw:
        _warn(source, "batches_per_step is deprecated; it is read as scheduling_unit")
        raw.setdefault("scheduling_unit", raw.pop("batches_per_step"))
    unit = raw.get("scheduling_unit", 100)
    for field in ("min_validation_period", "min_checkpoint_period"):
        period = raw.get(field)
        if isinstance(period, dict) and "steps" in period and isinstance(unit, int):
            _warn(source, f"{field}.steps is deprecated; use {{batches: N}} ({unit} per step)")
            steps = period.pop("steps")
            if isinstance(steps, int):
                period["batches"] = steps * unit
            else:
                period["batches"] = steps
    searcher = raw.get("searcher")
    if isinstance(searcher, dict):
        if "max_steps" in searcher:
            _warn(source, "searcher.max_steps is deprecated; use max_length: {batches: N}")
        name = searcher.get("name")
        if name in ("adaptive", "adaptive_simple", "pbt", "sync_halving", "async_halving"):
            raise ConfigError(
                f"{source}: searcher.name {name!r} was removed from Determined and is not "
                "supported; use `adaptive_asha` (or grid/random)"
            )
    optimizations = raw.get("optimizations")
    if isinstance(optimizations, dict) and optimizations.get("mixed_precision") not in (None, "O0"):
        _warn(
            source,
            "optimizations.mixed_precision is deprecated and has no effect; call "
            "context.wrap_scaler(torch.amp.GradScaler()) or context.experimental.use_amp() "
            "in the trial instead",
        )
    return raw


def describe_validation_error(
    err: ValidationError,
    raw: dict[str, Any],
    source: str,
    under: tuple[str, ...] = (),
    models: list[type[BaseModel]] | None = None,
) -> str:
    """A pydantic error as our one-paragraph message: field, value, fix (the job config's
    loader words its errors the same way). ``under``: where in ``raw`` the validated part
    sits; ``models``: the models whose fields an unknown key is matched against there (a
    plug-in's options), instead of walking the config's own."""
    lines = []
    for item in err.errors()[:5]:
        loc = [*under, *(p for p in item["loc"] if not _is_union_tag(p))]
        path = ".".join(str(p) for p in loc) or "(top level)"
        kind = item["type"]
        value = _lookup(raw, loc)
        if kind == "extra_forbidden":
            fix = _suggest(loc, raw) if models is None else _closest(loc, models)
            lines.append(f"unknown field `{path}`{fix}")
        elif kind == "missing":
            lines.append(f"required field `{path}` is missing")
        elif not loc:
            lines.append(item["msg"].removeprefix("Value error, "))
        else:
            msg = item["msg"].removeprefix("Value error, ")
            msg = FINITE_FIX if kind == "finite_number" else msg
            if msg.startswith("`"):
                lines.append(msg)
                continue
            if kind == "literal_error" and isinstance(value, str):
                options = re.findall(r"'([^']*)'", str(item.get("ctx", {}).get("expected", "")))
                close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
                msg += f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"`{path}` = {_short(value)} is invalid: {msg}")
    more = len(err.errors()) - 5
    tail = f" (and {more} more)" if more > 0 else ""
    return f"{source}: " + "; ".join(lines) + tail


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and part in {"const", "int", "double", "log", "categorical"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _lookup(raw: Any, loc: list[Any]) -> Any:
    node = raw
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node)
        ):
            node = node[part]
        else:
            return None
    return node


def _suggest(loc: list[Any], raw: dict[str, Any]) -> str:
    if not loc:  # the error is about the document itself (only union tags in its path)
        return ""
    if len(loc) == 2 and loc[0] == "checkpoint_storage":  # its fields are its type's
        return _closest(loc, [options_model(raw.get("checkpoint_storage"))])
    models: list[type[BaseModel]] = [ExperimentConfig]
    for part in loc[:-1]:
        fields = [m.model_fields[str(part)] for m in models if str(part) in m.model_fields]
        models = [m for f in fields for m in _models_of(f.annotation)]
    return _closest(loc, models)


_INTERNAL = {"plugin_fields"}  # fields the config model fills in, never written by a user


def _closest(loc: list[Any], models: list[type[BaseModel]]) -> str:
    """The field of ``models`` closest to the unknown key ``loc[-1]``, or all of them."""
    names = list(dict.fromkeys(n for m in models for n in m.model_fields if n not in _INTERNAL))
    if not names:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return f"; allowed fields here: {', '.join(names)}"


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) or () for m in _models_of(arg)]
