"""`rlrecipe grade FILE`: grade a JSONL file of responses with the reward's grader, print a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlrecipe.reward import DEFAULT_TIMEOUT


def grade(file: Path, out: Annotated[Path | None, typer.Option(help="graded JSONL")] = None,
          timeout: Annotated[float, typer.Option(help="seconds per answer")] = DEFAULT_TIMEOUT) -> None:
    """Grade JSONL rows with `response` and `answer`/`answers`."""
    from rich.console import Console

    from rlrecipe.recipe.training import RLSection
    from rlrecipe.reward.grade_file import grade_file

    rl = RLSection()  # no recipe here: the schema's default rewards
    written, results = grade_file(file, (rl.reward_correct, rl.reward_wrong), out, timeout)
    n = len(results)
    correct = sum(r.correct for r in results)
    timeouts = sum(r.timed_out for r in results)
    no_answer = sum(r.extracted is None for r in results)
    acc = f"{100.0 * correct / n:.1f}%" if n else "-"
    Console().print(f"graded [bold]{n}[/] rows: accuracy [bold]{acc}[/] ({correct}/{n}), "
                    f"no answer {no_answer}, timeouts {timeouts} -> {written}", highlight=False, soft_wrap=True)
