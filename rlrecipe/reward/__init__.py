r"""Reward: the one grading path shared by RL rewards, training-time validation and final eval.

A response is graded by taking the content of its last ``\boxed{...}`` and comparing it with the
reference answer(s):

1. Fast path, in the calling process, no math-verify (`answers`): after light normalisation
   (``\text{}`` wrappers, ``$``, spaces, ``\left``/``\right``, ``\dfrac``) the answer equals a
   reference, both are plain integers (``070 == 70``), both are plain numbers equal as exact
   rationals (``0.5 == \frac{2}{4}``), or single letters (a choice, ``b == B``). Wrong only where
   math-verify would say so too. This keeps RL on numeric and multiple-choice answers cheap.
2. Otherwise math-verify (`parse` + `verify`, run by `worker`; wrong constants far apart are
   settled there by their values, `values_apart`) decides, in a pool of worker
   processes with a hard time limit per answer (`grader`).
"""

from rlrecipe.reward.answers import extract_boxed, fast_grade, normalize_answer
from rlrecipe.reward.grader import (
    DEFAULT_TIMEOUT,
    Grader,
    GradeResult,
    default_workers,
    grade_trajectories,
    reward_of,
)
from rlrecipe.reward.worker import math_verify_correct

__all__ = [
    "DEFAULT_TIMEOUT",
    "Grader",
    "GradeResult",
    "default_workers",
    "extract_boxed",
    "fast_grade",
    "grade_trajectories",
    "math_verify_correct",
    "normalize_answer",
    "reward_of",
]
