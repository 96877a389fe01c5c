"""metrics.jsonl read back: one JSON object a line; a last line a kill cut short is skipped."""

from __future__ import annotations

import json
from pathlib import Path


def metric_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) of a metrics.jsonl; a line that is not a JSON object (cut short by a kill) is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append((line, row))
    return out


def read_metrics(path: Path) -> list[dict]:
    return [row for _, row in metric_lines(path)] if path.exists() else []
