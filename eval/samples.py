"""samples.jsonl as a journal: graded samples are appended as evaluation goes, and a killed eval
picks up what is on disk instead of generating it again.

A key file beside the journal (`<name>.key`) holds the digest of everything that decides a
sample's content (model files, sampling settings, seed, problems, engine). Samples written under
another key are set aside (renamed `.stale`), never mixed in. A last line cut short by the kill
is dropped and its sample generated again; a broken line anywhere else is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sample_seed(seed: int, problem_id: str, index: int) -> int:
    """Sample `index` of problem `problem_id`'s own seed: a function of these three alone (62 bits,
    so it fits any engine's signed 64-bit seed)."""
    raw = hashlib.sha256(f"{seed}\0{problem_id}\0{index}".encode()).digest()
    return int.from_bytes(raw[:8], "big") >> 2


def model_fingerprint(model: str) -> object:
    """A local model directory by its files' names, sizes and modification times (re-exported
    weights change it, reading 15 GB to hash them would not be worth it); anything else by name."""
    path = Path(model)
    if not path.is_dir():
        return model
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.iterdir())
            if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)]


class SampleJournal:
    """One benchmark's samples.jsonl, opened for appending; `done` holds the rows already there.
    With no path it only keeps rows in memory (training-time validation without an out_dir)."""

    def __init__(self, path: Path | None, key: str = "", resume: bool = True):
        self.done: dict[str, dict] = {}
        self.path = None if path is None else Path(path)
        if self.path is None:
            return
        self.key_path = self.path.with_name(self.path.name + ".key")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        same = resume and self.key_path.exists() and self.key_path.read_text().strip() == key
        if not same and self.path.exists():
            if resume:  # kept for inspection, out of the way of the new samples
                self.path.replace(self.path.with_name(self.path.name + ".stale"))
            else:
                self.path.unlink()
        self.done = self._read_and_repair() if same else {}
        atomic_write_text(self.key_path, key + "\n")

    def _read_and_repair(self) -> dict[str, dict]:
        """The complete rows by sample id; a partial last line is cut off the file."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        rows: dict[str, dict] = {}
        good_end = 0
        pos = 0
        lineno = 0
        while pos < len(data):
            lineno += 1
            end = data.find(b"\n", pos)
            last = end == -1 or data[end + 1:].strip() == b""
            line = data[pos:] if end == -1 else data[pos:end]
            try:
                row = json.loads(line) if line.strip() else None
                if row is not None and not (isinstance(row, dict) and isinstance(row.get("sample"), str)):
                    raise ValueError("not a sample row")
            except ValueError as err:
                if last:
                    break  # the line a kill cut short
                raise UserError(f"{self.path}:{lineno}: not a sample row ({err}); delete the file to "
                                "evaluate this benchmark from scratch") from None
            if end == -1:
                break  # complete JSON but no newline: the write may have stopped mid-number; redo it
            if row is not None:
                rows.setdefault(row["sample"], row)
            good_end = pos = end + 1
        if good_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        return rows

    def append(self, rows: list[dict]) -> None:
        """Write rows and make them durable before the caller moves on (a kill keeps them)."""
        if rows and self.path is not None:
            self._write(rows)
        for r in rows:
            self.done.setdefault(r["sample"], r)

    def _write(self, rows: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
