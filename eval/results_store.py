"""The results kept in the repository: one small JSON per recorded result, and the mismatch study.

Run directories live on the machine that ran them (`runs/` is not tracked), so RESULTS.md is
generated from this store first and from local runs second: a fresh clone regenerates the same
file, and a result whose run is elsewhere keeps its row. A local result enters the store, or
replaces the stored one of the same recipe, model and benchmark, only when asked
(`rlrecipe results --record`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.errors import UserError

STORE = Path("results")
RECORDS = "records"
STUDY = "mismatch-study.json"
ASYNC_STUDY = "async-study.json"
ASYNC_STUDY_EQUAL_STEPS = "async-study-equal-steps.json"  # the first async study: equal steps only
OPTIONS_STUDY = "options-study.json"
FP8_STUDY = "fp8-study.json"
LORA_STUDY = "lora-study.json"
DROP = {"per_problem"}  # per-problem detail stays in the run directory


def result_key(r: dict[str, Any]) -> tuple[str, str, str]:
    return (r["recipe"], r["model"], r["benchmark"])


def record_name(r: dict[str, Any]) -> str:
    """A file name that says what the record is: recipe stem, model and benchmark."""
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "x"

    return f"{slug(Path(r['recipe']).stem)}__{slug(r['model'])}__{slug(r['benchmark'])}.json"


def load_records(store: str | Path = STORE) -> list[dict[str, Any]]:
    """Every stored result, checked as a summary is; UserError names a damaged file."""
    from rlrecipe.eval.report import check_record

    root = Path(store) / RECORDS
    out = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{path}: not a readable result record ({err})") from None
        record = check_record(record, path)
        record["stored_as"] = path.as_posix()
        out.append(record)
    return out


def save_record(r: dict[str, Any], store: str | Path = STORE) -> Path:
    record = {k: v for k, v in r.items() if k not in DROP and k not in ("stored_as", "source")}
    record["pass_at_k"] = {str(k): v for k, v in r.get("pass_at_k", {}).items()}
    path = Path(store) / RECORDS / record_name(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def read_study(path: Path) -> dict[str, Any] | None:
    """A study's JSON (kept here or a run's study.json), None when absent; UserError names a damaged one."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable study record ({err})") from None


def load_stored_study(store: str | Path = STORE, name: str = STUDY) -> dict[str, Any] | None:
    return read_study(Path(store) / name)


def save_study(study: dict[str, Any], store: str | Path = STORE, name: str = STUDY,
               also: tuple[str, ...] = ()) -> Path:
    """A study's table and plan (what RESULTS.md renders), without the per-run detail unless `also`
    names it (the FP8 study keeps its per-run rows, their curves left in the run folder)."""
    kept = {k: study[k] for k in ("plan", "table", "collapse_rule", "provenance", "time_table", "figure", *also)
            if k in study}
    path = Path(store) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(kept, indent=2, sort_keys=True) + "\n")
    return path


def merge(stored: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored results, then local ones for a (recipe, model, benchmark) the store lacks; each marked
    with its source. A local result never displaces a stored one here (see `record`)."""
    have = {result_key(r): {**r, "source": "recorded"} for r in stored}
    for r in local:
        have.setdefault(result_key(r), {**r, "source": "local"})
    return [have[k] for k in sorted(have)]


def pending(stored: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Local results that differ from the stored one of their key: what `--record` would replace."""
    by_key = {result_key(r): r for r in stored}
    out = []
    for r in local:
        old = by_key.get(result_key(r))
        if old is not None and (old.get("date"), old.get("recipe_sha256"), old.get("avg")) != (
                r.get("date"), r.get("recipe_sha256"), r.get("avg")):
            out.append(r)
    return out
