r"""Reward: the one grading path shared by RL rewards, training-time validation and final eval.

The verdict is math-verify's: the content of a response's last ``\boxed{...}`` and each reference
answer, boxed (`worker._parse`) and parsed with the same extraction configs, are compared by
math-verify's `verify`; correct when one reference matches. No box, an empty or unbalanced last
box, or a truncated response is wrong. Two ways of getting there, with the same verdicts:

1. Fast path, in the calling process, no math-verify (`answers`): only where both the answer and a
   reference are written exactly as a plain integer (``070 == 70``), rational (``\frac{1}{2}``,
   ``1/2``), decimal (``0.5``) or single letter (a choice, ``b == B``), whose parse and comparison
   math-verify's rules fix. Nothing is cleaned up first. This keeps RL on numeric and
   multiple-choice answers cheap.
2. Otherwise math-verify (`parse` + `verify`, run by `worker`; wrong constants far apart are
   settled there by their values, `values_apart`) decides, in a pool of worker
   processes with a hard time limit per answer (`grader`).

tests/test_grading_differential.py compares the two with math-verify alone, in clean
interpreters, on a corpus of more than 10,000 answers.
"""

from rlrecipe.reward.answers import extract_boxed, fast_grade
from rlrecipe.reward.grader import (
    DEFAULT_TIMEOUT,
    Grader,
    GradeResult,
    default_workers,
    grade_trajectories,
    reward_of,
)
from rlrecipe.reward.worker import math_verify_correct


def grader_name() -> str:
    """What produces a verdict, as results record it: math-verify and its version (docs/grader.md)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"math-verify {version('math-verify')}"
    except PackageNotFoundError:
        return "math-verify"


__all__ = [
    "DEFAULT_TIMEOUT",
    "Grader",
    "GradeResult",
    "default_workers",
    "extract_boxed",
    "fast_grade",
    "grade_trajectories",
    "grader_name",
    "math_verify_correct",
    "reward_of",
]
