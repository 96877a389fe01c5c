"""Grading a JSONL file of responses (`rlrecipe grade`): each row's `response` against its
`answer`/`answers` with the reward's grader, written back with the verdict and the reward."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.errors import UserError
from rlrecipe.data.io import json_lines
from rlrecipe.reward.grader import DEFAULT_TIMEOUT, Grader, GradeResult, reward_of


def read_grading_rows(file: Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    """(line number, row, answers) for each JSONL row; UserError naming file:line on a bad row."""
    rows = []
    for lineno, row in json_lines(file):
        where = f"{file}:{lineno}"
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if not isinstance(row.get("response"), str):
            raise UserError(f"{where}: missing string field 'response'")
        if "answers" in row:
            refs = row["answers"]
            if not isinstance(refs, list) or not refs or not all(_is_answer(a) for a in refs):
                raise UserError(f"{where}: 'answers' must be a non-empty list of strings")
        elif "answer" in row:
            if not _is_answer(row["answer"]):
                raise UserError(f"{where}: 'answer' must be a string")
            refs = [row["answer"]]
        else:
            raise UserError(f"{where}: missing field 'answer' (or 'answers')")
        if "truncated" in row and not isinstance(row["truncated"], bool):
            raise UserError(f"{where}: 'truncated' must be true or false")
        rows.append((lineno, row, [str(a) for a in refs]))
    return rows


def _is_answer(a: Any) -> bool:
    if isinstance(a, float) and not math.isfinite(a):  # JSON's NaN/Infinity
        return False
    return isinstance(a, (str, int, float)) and not isinstance(a, bool)


def grade_file(file: Path | str, rewards: tuple[float, float], out: Path | str | None = None,
               timeout: float = DEFAULT_TIMEOUT) -> tuple[Path, list[GradeResult]]:
    """Grade a JSONL file of `response` + `answer`/`answers` rows into `out` (default
    `<stem>.graded.jsonl`); each row gains `extracted`, `correct`, `timed_out` and `reward`
    (`rewards` = (correct, wrong)). Returns where the rows went and the verdicts."""
    if not (0 < timeout < math.inf):  # NaN fails this too
        raise UserError(f"--timeout must be a positive number of seconds, got {timeout}")
    file = Path(file)
    rows = read_grading_rows(file)
    if not rows:
        raise UserError(f"{file}: no rows to grade")
    out = Path(out) if out is not None else file.with_name(file.stem + ".graded.jsonl")
    with Grader(timeout=timeout) as grader:
        results = grader.grade([r["response"] for _, r, _ in rows], [a for _, _, a in rows],
                               [bool(r.get("truncated", False)) for _, r, _ in rows])
    lines = []
    for (_, row, _), res in zip(rows, results, strict=True):
        row = {**row, "extracted": res.extracted, "correct": res.correct, "timed_out": res.timed_out,
               "reward": reward_of(res, *rewards)}
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(lines))
    except OSError as err:
        raise UserError(f"{out}: cannot write: {err}") from None
    return out, results
