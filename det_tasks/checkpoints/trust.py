"""Whose checkpoint code may run here. Importing a checkpoint's ``code/`` executes Python,
so it is allowed only for checkpoints this installation wrote (their manifest carries an
HMAC made with the installation's signing key), for references resolved through the
allow-listed registry schemes (``runs:/``, ``models:/`` of the configured MLflow), or when
the caller says ``trust_code=True``. Weights are loaded ``weights_only`` regardless.

Several hosts of one installation share the key through ``DET_TASKS_SIGNING_KEY``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from det_tasks.home import det_tasks_home

__all__ = [
    "SIGNING_KEY_ENV",
    "TRUSTED_SCHEMES_ENV",
    "installation_key",
    "is_signed_here",
    "sign_manifest",
    "trusted_schemes",
]

SIGNING_KEY_ENV = "DET_TASKS_SIGNING_KEY"
TRUSTED_SCHEMES_ENV = "DET_TASKS_TRUSTED_SCHEMES"
_DEFAULT_TRUSTED = ("runs", "models")


def installation_key() -> bytes:
    """``$DET_TASKS_SIGNING_KEY``, else a random key kept (mode 0600) in
    ``$DET_TASKS_HOME/signing.key``, created on first use."""
    from_env = os.environ.get(SIGNING_KEY_ENV)
    if from_env:
        return from_env.encode()
    path = det_tasks_home() / "signing.key"
    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".key-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):  # another process won the race: use its key
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return path.read_bytes().strip()


def sign_manifest(files: dict[str, Any]) -> str:
    """The HMAC-SHA256 of a checkpoint's file manifest (names, sizes, sha256s)."""
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(installation_key(), canonical, hashlib.sha256).hexdigest()


def is_signed_here(directory: Path, metadata: dict[str, Any]) -> bool:
    """Whether this installation signed the (already verified) manifest and ``code/`` holds
    nothing the manifest does not list."""
    files = metadata.get("files")
    signature = metadata.get("signature")
    if not isinstance(files, dict) or not isinstance(signature, str):
        return False
    if not hmac.compare_digest(signature, sign_manifest(files)):
        return False
    code = directory / "code"
    present = {
        p.relative_to(directory).as_posix()
        for p in code.rglob("*")
        if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts
    }
    return present <= set(files)


def trusted_schemes() -> tuple[str, ...]:
    """Reference schemes whose checkpoints come from an allow-listed registry."""
    raw = os.environ.get(TRUSTED_SCHEMES_ENV)
    if raw is None:
        return _DEFAULT_TRUSTED
    return tuple(s.strip().lower() for s in raw.split(",") if s.strip())
