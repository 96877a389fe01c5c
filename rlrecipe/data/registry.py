"""Dataset registry (data/registry.yaml): name -> hub location, pinned revision, checksum.

Also the checksum lock (`<dest>/checksums.lock`): for entries whose sha256 the registry does not
pin, the first download records the commit and sha256 it got; later downloads fetch that commit
and refuse a file whose sha256 changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.errors import UserError

REGISTRY_PATH = Path(__file__).resolve().parents[2] / "data" / "registry.yaml"
DATA_DIR = REGISTRY_PATH.parent
LOCK_NAME = "checksums.lock"

KINDS = ("rl", "sft", "eval")
FORMATS = ("areal-rl", "areal-sft", "eval", "auto")
_REQUIRED = ("repo", "filename", "revision", "kind")


@dataclass(frozen=True)
class Entry:
    name: str
    repo: str
    filename: str
    revision: str
    kind: str
    repo_type: str = "dataset"
    sha256: str | None = None
    format: str = "auto"
    description: str = ""


def load_registry(path: Path = REGISTRY_PATH) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: invalid YAML ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of dataset name -> entry")
    return data


def is_registered(name: str) -> bool:
    return name in load_registry()


def get_entry(name: str, path: Path = REGISTRY_PATH) -> Entry:
    """The validated registry entry for `name`; a UserError names the file and field otherwise."""
    registry = load_registry(path)
    if name not in registry:
        known = ", ".join(sorted(registry)) or "none"
        raise UserError(f"{path}: no dataset named {name!r} (registered: {known}); "
                        f"for a file obtained elsewhere use `rlrecipe data import FILE --as {name} --kind ...`")
    raw = registry[name]
    if not isinstance(raw, dict):
        raise UserError(f"{path}: entry {name!r} must be a mapping")
    for key in _REQUIRED:
        if not raw.get(key):
            raise UserError(f"{path}: entry {name!r} is missing field {key!r}")
    if raw["kind"] not in KINDS:
        raise UserError(f"{path}: entry {name!r} field 'kind' is {raw['kind']!r}; expected one of {', '.join(KINDS)}")
    fmt = raw.get("format") or "auto"
    if fmt not in FORMATS:
        raise UserError(f"{path}: entry {name!r} field 'format' is {fmt!r}; expected one of {', '.join(FORMATS)}")
    sha = raw.get("sha256")
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise UserError(f"{path}: entry {name!r} field 'sha256' must be 64 lowercase hex digits or null")
    return Entry(name=name, repo=str(raw["repo"]), filename=str(raw["filename"]), revision=str(raw["revision"]),
                 kind=raw["kind"], repo_type=str(raw.get("repo_type") or "dataset"), sha256=sha, format=fmt,
                 description=str(raw.get("description") or ""))


# --- checksum lock --------------------------------------------------------------------------------

def lock_path(dest: Path) -> Path:
    return Path(dest) / LOCK_NAME


def load_lock(dest: Path) -> dict[str, dict]:
    path = lock_path(dest)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: malformed JSON in the checksum lock ({err.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object of 'name@revision' -> record")
    return data


def lock_key(name: str, revision: str) -> str:
    return f"{name}@{revision}"


def record_lock(dest: Path, key: str, record: dict) -> Path:
    """Add or replace one lock record; the file is rewritten atomically."""
    data = load_lock(dest)
    data[key] = record
    path = lock_path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path

