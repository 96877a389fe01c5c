"""Checkpoint manifests: every file of a checkpoint with its size and sha256, written last.

A checkpoint whose manifest is missing, or whose files do not match it, is incomplete or
damaged (a kill mid-write, a full disk, a truncated copy) and must not be resumed from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: Path, identity: dict | None = None) -> Path:
    """List every file under `directory` (but the manifest itself); call once all are written.

    `identity`: which run wrote it (its experiment sha256, seed, stage and step), checked on resume."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    path = directory / MANIFEST
    body = {"files": files, **({"run": identity} if identity is not None else {})}
    path.write_text(json.dumps(body, indent=1))  # the caller's rename of the directory commits it
    return path


def read_identity(directory: Path) -> dict | None:
    """The `run` record of a checkpoint's manifest; None for one written before checkpoints had it."""
    try:
        ident = json.loads((Path(directory) / MANIFEST).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return ident if isinstance(ident, dict) else None


def check_manifest(directory: Path) -> str | None:
    """None when every listed file is there with its size and sha256; else what is wrong."""
    directory = Path(directory)
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the write did not finish)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    # sizes first: cheap, and they catch truncation before any hashing
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, expected {want['size']}"
    for name, want in files.items():
        if _sha256(directory / name) != want["sha256"]:
            return f"{name} does not match its sha256"
    return None
