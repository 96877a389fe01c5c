"""Dataset registry (data/registry.yaml): name -> hub location, pinned revision, checksum."""

from __future__ import annotations

from pathlib import Path

import yaml

REGISTRY_PATH = Path(__file__).resolve().parents[2] / "data" / "registry.yaml"


def load_registry(path: Path = REGISTRY_PATH) -> dict[str, dict]:
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def is_registered(name: str) -> bool:
    return name in load_registry()
