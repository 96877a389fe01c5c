"""Reading and writing canonical JSONL datasets.

Canonical rows (one JSON object per line; extra keys are allowed and kept):
  rl    id, prompt, answers   answers: non-empty list of reference answers (strings)
  sft   id, prompt, response
  eval  id, problem, answer   answer: a string (AIME answers are integers written as strings)

`read_jsonl` checks every row and raises one UserError naming the file and line of the first
bad one; numeric answers are normalised to strings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_open
from rlrecipe.core.errors import UserError
from rlrecipe.data.registry import is_registered

REQUIRED = {"rl": ("id", "prompt", "answers"), "sft": ("id", "prompt", "response"), "eval": ("id", "problem", "answer")}


def resolve_dataset_path(name_or_path: str, kind: str) -> Path:
    """A registry name maps to its converted file under data/<name>/; anything else is a path.

    A name imported with `rlrecipe data import FILE --as NAME` (not in the registry) resolves to
    data/<name>/<kind>.jsonl too, when that file exists and no file of that name does; a directory
    resolves to its <kind>.jsonl.
    """
    from rlrecipe.data.registry import DATA_DIR, is_registered

    if is_registered(name_or_path):
        path = DATA_DIR / name_or_path / f"{kind}.jsonl"
        if not path.exists():
            raise UserError(f"{path}: not downloaded yet; run `rlrecipe data download {name_or_path}`")
        return path
    path = Path(name_or_path)
    if path.is_dir() and (path / f"{kind}.jsonl").exists():
        return path / f"{kind}.jsonl"
    imported = DATA_DIR / name_or_path / f"{kind}.jsonl"
    if not path.exists() and "/" not in name_or_path and imported.exists():
        return imported
    return path


def answer_text(value) -> str | None:
    """A reference answer as a non-empty string, or None if it is not one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):  # JSON's NaN/Infinity: no answer can equal it
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _nonempty_str(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def check_row(row, kind: str) -> tuple[dict | None, str | None]:
    """(normalised row, None) for a good canonical row, (None, reason) for a bad one."""
    if kind not in REQUIRED:
        raise ValueError(f"unknown dataset kind {kind!r}")
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    missing = [k for k in REQUIRED[kind] if k not in row]
    if missing:
        return None, f"missing field(s) {', '.join(missing)} for {'an' if kind == 'eval' else 'a'} {kind} row"
    rid = row["id"]
    if isinstance(rid, bool) or not (isinstance(rid, int) or _nonempty_str(rid)):
        return None, "field 'id' must be a non-empty string or an integer"
    out = dict(row)
    if kind == "rl":
        if not _nonempty_str(row["prompt"]):
            return None, "field 'prompt' is empty or not a string"
        answers = row["answers"]
        if not isinstance(answers, list):
            return None, f"field 'answers' must be a list of strings, got {type(answers).__name__}"
        if not answers:
            return None, "field 'answers' is empty"
        texts = [answer_text(a) for a in answers]
        if any(t is None for t in texts):
            return None, "field 'answers' contains an empty or non-string answer"
        out["answers"] = texts
    elif kind == "sft":
        if not _nonempty_str(row["prompt"]):
            return None, "field 'prompt' is empty or not a string"
        if not _nonempty_str(row["response"]):
            return None, "field 'response' is empty or not a string"
    else:
        if not _nonempty_str(row["problem"]):
            return None, "field 'problem' is empty or not a string"
        text = answer_text(row["answer"])
        if text is None:
            return None, "field 'answer' is empty or not a string/number"
        out["answer"] = text
    return out, None


def how_to_make(path: Path) -> str:
    """The command that writes a missing canonical file, when its folder names a known dataset."""
    name = path.parent.name
    if name == "tiny-arith":
        return f"; make it with `rlrecipe data make tiny-arith --out {path.parent}`"
    try:
        known = is_registered(name)
    except UserError:  # no readable registry: no hint, the missing file is still the error
        known = False
    if known:
        return f"; fetch it with `rlrecipe data download {name}`"
    return ""


def json_lines(path: str | Path, hint: Callable[[], str] | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; the first unreadable line
    raises a UserError naming path:line. `hint()` follows a missing file's message."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: file not found{hint() if hint else ''}")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a JSONL file")
    try:
        f = path.open("rb")
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or err}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                # a byte-order mark opening the file is accepted, as it is in a recipe
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno})") from None
            except RecursionError:
                raise UserError(f"{path}:{lineno}: JSON nested too deeply") from None
            except ValueError as err:  # an integer of thousands of digits (Python's conversion limit)
                raise UserError(f"{path}:{lineno}: a number too long to read ({str(err).split(';')[0]})") from None


def read_jsonl(path: str | Path, kind: str) -> list[dict]:
    """All rows of a canonical JSONL file; the first bad line raises a UserError naming path:line."""
    if kind not in REQUIRED:
        raise UserError(f"unknown dataset kind {kind!r}; expected one of {', '.join(REQUIRED)}")
    path = Path(path)
    rows = []
    seen: dict[str, int] = {}  # id -> the line it was first on
    for lineno, row in json_lines(path, lambda: how_to_make(path)):
        good, reason = check_row(row, kind)
        if reason is not None:
            raise UserError(f"{path}:{lineno}: {reason}")
        rid = str(good["id"])  # 7 and "7" name the same row in results and rollout groups
        if rid in seen:
            raise UserError(f"{path}:{lineno}: id {good['id']!r} is already the id of line {seen[rid]}; ids name "
                            "rows in rollout groups and results, so each must be unique")
        seen[rid] = lineno
        rows.append(good)
    return rows


def load_rows(name_or_path: str, kind: str) -> list[dict]:
    return read_jsonl(resolve_dataset_path(name_or_path, kind), kind)


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> int:
    """Write rows to a temp file next to `path` and rename it into place; returns the row count.

    A failure leaves any previous file at `path` untouched and no partial file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
