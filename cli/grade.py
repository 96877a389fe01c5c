"""`rlrecipe grade FILE`: grade a JSONL file of responses with the reward's grader, print a summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from rlrecipe.core.errors import UserError
from rlrecipe.reward import DEFAULT_TIMEOUT


def grade(file: Path, out: Annotated[Path | None, typer.Option(help="graded JSONL")] = None,
          timeout: Annotated[float, typer.Option(help="seconds per answer")] = DEFAULT_TIMEOUT) -> None:
    """Grade JSONL rows with `response` and `answer`/`answers`."""
    grade_file(file, out, timeout)


def read_grading_rows(file: Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    """(line number, row, answers) for each JSONL row; UserError naming file:line on a bad row."""
    file = Path(file)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{file}: cannot read: {err}") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:
            raise UserError(f"{where}: JSON nested too deeply") from None
        except ValueError as err:  # an integer of thousands of digits (Python's conversion limit)
            raise UserError(f"{where}: a number too long to read ({str(err).split(';')[0]})") from None
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


def grade_file(file: Path | str, out: Path | str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Path:
    """Grade a JSONL file of `response` + `answer`/`answers` rows; write `<stem>.graded.jsonl`.

    Each row gains `extracted`, `correct`, `timed_out` and `reward` (the RL defaults' values).
    """
    from rlrecipe.core.atomic_io import atomic_write_text
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.reward import Grader, reward_of

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
    rl = RLSection()  # no recipe here: the recipe defaults' rewards
    lines = []
    for (_, row, _), res in zip(rows, results, strict=True):
        row = {**row, "extracted": res.extracted, "correct": res.correct, "timed_out": res.timed_out,
               "reward": reward_of(res, rl.reward_correct, rl.reward_wrong)}
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(lines))
    except OSError as err:
        raise UserError(f"{out}: cannot write: {err}") from None
    print_summary(results, out)
    return out


def print_summary(results: list, out: Path) -> None:
    """One line on stdout: accuracy, rows without an answer, timeouts, and where the rows went."""
    from rich.console import Console

    n = len(results)
    correct = sum(r.correct for r in results)
    timeouts = sum(r.timed_out for r in results)
    no_answer = sum(r.extracted is None for r in results)
    acc = f"{100.0 * correct / n:.1f}%" if n else "-"
    Console().print(f"graded [bold]{n}[/] rows: accuracy [bold]{acc}[/] ({correct}/{n}), "
                    f"no answer {no_answer}, timeouts {timeouts} -> {out}", highlight=False, soft_wrap=True)
