"""Which files of a model directory are its model definition: the code a package, a code
snapshot and each checkpoint's ``code/`` copy take.

Determined's rule is the base: everything in the directory but ``.detignore`` matches
(gitignore syntax, negation and directory patterns included) and its own defaults
(``__pycache__``, ``.git``, editor folders...), refused past Determined's limit. On top of
it, what is never code, wherever it sits in the tree, is always left out:

- credentials (``SECRET_FILES``);
- the platform's own homes, caches and databases: ``.det_tasks``, ``.prefect``, ``.stack``,
  ``.cache``, the folders ``DET_TASKS_HOME``, ``PREFECT_HOME``, the det_tasks cache and the
  user's home resolve to when they lie inside the directory (a home inside a copy of an
  example put every MLflow and Prefect database into every checkpoint), SQLite databases
  (by their header, whatever their name) with their ``-wal``/``-shm``/``-journal``/``.lock``
  files;
- checkpoint folders (a folder holding ``state_dict.pth`` beside ``load_data.json`` or
  ``metadata.json``), wherever they are, and those the caller names by location.

A file that vanishes while it is listed or read (a staging folder, a database's journal) is
skipped, not an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pathspec

__all__ = [
    "ALWAYS_IGNORED",
    "DETERMINED_DETIGNORE",
    "MAX_MODEL_DEF_BYTES",
    "PLATFORM_IGNORED",
    "SECRET_FILES",
    "model_files",
    "over_limit",
    "platform_dirs",
    "sized",
]

# Determined 0.38.1 (harness/determined/common/constants.py): MAX_CONTEXT_SIZE, the largest
# model definition `det experiment create` sends: (128 MiB // 8) * 6 - 1 MiB = 95 MiB.
MAX_MODEL_DEF_BYTES = (128 * 1024 * 1024 // 8) * 6 - 1024 * 1024

# Determined 0.38.1's DEFAULT_DETIGNORE, applied before a directory's own .detignore.
DETERMINED_DETIGNORE = [
    "__pycache__/",
    "*.py[co]",
    "*$py.class",
    "terraform",
    "terraform_data",
    "terraform.tfstate*",
    "terraform.tfvars*",
    ".terraform*",
    ".git/",
    ".vscode/",
    ".idea/",
    ".mypy_cache/",
    "/shared_fs",
]
# Credentials never leave the machine inside a package or a checkpoint's code/ copy.
SECRET_FILES = [
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_rsa*",
    "id_ecdsa*",
    "id_ed25519*",
    ".netrc",
    ".pgpass",
    ".git-credentials",
    ".aws/",
    ".ssh/",
]
# The platform's homes, caches and databases under their usual names, at any depth.
PLATFORM_IGNORED = [
    ".det_tasks/",
    ".prefect/",
    ".stack/",
    ".cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    "*.db",
    "*.sqlite",
    "*.sqlite3",
    "*.db-wal",
    "*.db-shm",
    "*.db-journal",
    "*.db.lock",
    "*.sqlite-wal",
    "*.sqlite-shm",
    "*.sqlite-journal",
]
# Applied after .detignore, so a negation there cannot bring them back.
ALWAYS_IGNORED = [".detignore~", *SECRET_FILES, *PLATFORM_IGNORED]

_SQLITE_HEADER = b"SQLite format 3\x00"
_SIDECARS = ("-wal", "-shm", "-journal", ".lock")
_CHECKPOINT_MARKERS = ("load_data.json", "metadata.json")


def platform_dirs() -> list[Path]:
    """The folders this process's platform writes to (det_tasks' home, Prefect's, the
    det_tasks cache) and the user's home: none of them is ever model code."""
    env = os.environ
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no passwd entry: only the named folders
        home = None
    folders: list[str | Path | None] = [
        env.get(name) for name in ("DET_TASKS_HOME", "PREFECT_HOME", "DET_TASKS_CACHE_DIR")
    ]
    if home is not None:
        folders += [home / ".det_tasks", home / ".prefect", home / ".cache", home]
    if env.get("DET_TASKS_ARTIFACT_ROOT"):
        folders.append(env["DET_TASKS_ARTIFACT_ROOT"])
    return [Path(f).expanduser() for f in folders if f]


def _spec(model_dir: Path, extra: Sequence[str]) -> pathspec.GitIgnoreSpec:
    lines = list(DETERMINED_DETIGNORE)
    detignore = model_dir / ".detignore"
    if detignore.is_file():
        lines += detignore.read_text(encoding="utf-8", errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines([*lines, *ALWAYS_IGNORED, *extra])


def model_files(
    model_dir: Path,
    extra_ignored: Sequence[str] | None = None,
    excluded_dirs: Sequence[Path] = (),
) -> list[tuple[str, Path]]:
    """(relative name, path) of every file of the model definition, sorted: minus
    ``.detignore`` matches, what is never code (see the module), ``extra_ignored``
    patterns, and the folders ``excluded_dirs`` (the config's checkpoint folders: matched
    by location, since a pattern cannot say "this ./ckpt, not a package's ckpt/")."""
    spec = _spec(model_dir, extra_ignored or ())
    excluded = _relative_dirs(model_dir, [*excluded_dirs, *platform_dirs()])
    found: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(model_dir):
        rel_root = Path(root).relative_to(model_dir)
        dirs[:] = sorted(
            d
            for d in dirs
            if not spec.match_file(f"{(rel_root / d).as_posix()}/")
            and (rel_root / d).as_posix() not in excluded
            and not _is_checkpoint(Path(root) / d)
        )
        kept = [n for n in sorted(names) if not spec.match_file((rel_root / n).as_posix())]
        databases = {n for n in kept if _is_sqlite(Path(root) / n)}
        for name in kept:
            path = Path(root) / name
            if name in databases or _is_sidecar(name, databases) or not path.is_file():
                continue
            found.append(((rel_root / name).as_posix(), path))
    return found


def _relative_dirs(model_dir: Path, dirs: Iterable[Path]) -> set[str]:
    """``dirs`` that lie strictly inside ``model_dir``, relative to it (links resolved)."""
    base = model_dir.resolve()
    inside = set()
    for folder in dirs:
        resolved = Path(folder).expanduser().resolve()
        if base in resolved.parents:
            inside.add(resolved.relative_to(base).as_posix())
    return inside


def _is_checkpoint(folder: Path) -> bool:
    """A checkpoint folder (ours or Determined's): never code, wherever it sits."""
    return (folder / "state_dict.pth").is_file() and any(
        (folder / marker).is_file() for marker in _CHECKPOINT_MARKERS
    )


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:  # vanished, unreadable, a folder: not a database to leave out
        return False


def _is_sidecar(name: str, databases: set[str]) -> bool:
    """A database's journal, shared-memory or lock file, beside it."""
    return any(name == db + suffix for db in databases for suffix in _SIDECARS)


def sized(files: Sequence[tuple[str, Path]]) -> list[tuple[str, Path, int]]:
    """(name, path, bytes) of ``files``, without those that vanished meanwhile."""
    out = []
    for rel, path in files:
        try:
            out.append((rel, path, path.stat().st_size))
        except FileNotFoundError:
            continue
    return out


def over_limit(model_dir: Path, files: Sequence[tuple[str, Path, int]], limit: int) -> str | None:
    """The one line that refuses a model definition over ``limit`` bytes, naming its
    largest files and ``.detignore``; None within the limit."""
    total = sum(size for _, _, size in files)
    if total <= limit:
        return None
    largest = sorted(files, key=lambda f: f[2], reverse=True)[:5]
    names = ", ".join(f"{rel} ({size / 2**20:.1f} MB)" for rel, _, size in largest)
    return (
        f"model directory {str(model_dir)!r} holds {total / 2**20:.1f} MB of files, over the "
        f"{limit / 2**20:.0f} MB limit for a model definition (Determined's); largest files: "
        f"{names}. List them in {str(model_dir / '.detignore')!r} (gitignore syntax) and "
        "load data from storage instead of shipping it with the code"
    )
