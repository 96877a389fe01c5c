"""`rlrecipe data validate`: check a canonical JSONL file and count what a trainer would care about."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.data.io import read_jsonl


@dataclass
class ValidationReport:
    path: str
    kind: str
    rows: int
    duplicate_prompts: int  # repeated ids are refused by the reader; a repeated prompt is allowed
    extra: dict

    def summary_lines(self) -> list[str]:
        lines = [f"{self.path}: valid {self.kind} file",
                 f"rows:               {self.rows}",
                 f"duplicate prompts:  {self.duplicate_prompts}"]
        lines += [f"{k + ':':<20}{v}" for k, v in self.extra.items()]
        return lines


def _duplicates(values) -> int:
    """How many rows repeat a value seen earlier in the file."""
    return sum(c - 1 for c in Counter(values).values() if c > 1)


def validate_file(path: str | Path, kind: str) -> ValidationReport:
    """Raise UserError naming file:line for the first bad row (a repeated id too); otherwise count rows
    and repeated prompts."""
    rows = read_jsonl(path, kind)
    if not rows:
        raise UserError(f"{path}: no rows")
    text_key = "problem" if kind == "eval" else "prompt"
    extra: dict = {}
    if kind == "rl":
        n_answers = [len(r["answers"]) for r in rows]
        extra["answers per prompt"] = f"{sum(n_answers) / len(rows):.2f} (max {max(n_answers)})"
    elif kind == "sft":
        lengths = [len(r["response"]) for r in rows]
        extra["response chars"] = f"mean {sum(lengths) / len(rows):.0f}, max {max(lengths)}"
    return ValidationReport(path=str(path), kind=kind, rows=len(rows),
                            duplicate_prompts=_duplicates(r[text_key].strip() for r in rows),
                            extra=extra)
