"""Evaluation metrics: unbiased pass@k, per-problem accuracy, avg@n with its standard error.

avg@n is the mean accuracy over all n samples of all problems; its standard error is taken
over problems (the unit that was sampled): std of the per-problem means (ddof=1) divided by
sqrt(number of problems), 0 for a single problem.

pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), averaged over
problems. It is computed exactly with integer binomials and a rational before the one
conversion to float, so it neither overflows nor cancels for large n.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples (drawn from n with c correct) is correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def accuracy(correct: Sequence[bool]) -> float:
    """Fraction of correct samples of one problem."""
    if not correct:
        raise ValueError("no samples")
    return sum(bool(x) for x in correct) / len(correct)


def per_problem_accuracy(per_problem_correct: Mapping[str, Sequence[bool]]) -> dict[str, float]:
    return {pid: accuracy(v) for pid, v in per_problem_correct.items()}


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std with ddof=1 / sqrt(len)); se 0 for one value."""
    if not values:
        raise ValueError("no values")
    m = math.fsum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    var = math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def summarize(per_problem_correct: Mapping[str, Sequence[bool]], ks: Sequence[int] = (1,)) -> dict[str, Any]:
    """avg@n ± stderr, pass@k for each k <= n (and always k = n), and per-problem accuracy.

    Returns `avg`, `stderr` (fractions in [0, 1]), `n` (samples per problem; the smallest
    count when problems differ), `num_problems`, `num_samples`, `num_correct`,
    `pass_at_k` ({k: value}, int keys) and `per_problem` ({id: accuracy}).
    """
    if not per_problem_correct:
        raise ValueError("no problems to summarize")
    empty = [pid for pid, v in per_problem_correct.items() if len(v) == 0]
    if empty:
        raise ValueError(f"problem {empty[0]!r} has no samples")
    counts = {pid: (len(v), sum(bool(x) for x in v)) for pid, v in per_problem_correct.items()}
    n = min(m for m, _ in counts.values())
    per_problem = {pid: c / m for pid, (m, c) in counts.items()}
    num_samples = sum(m for m, _ in counts.values())
    num_correct = sum(c for _, c in counts.values())
    _, stderr = mean_and_stderr(list(per_problem.values()))
    wanted = sorted({int(k) for k in ks if 1 <= int(k) <= n} | {n})
    pass_k = {k: math.fsum(pass_at_k(m, c, k) for m, c in counts.values()) / len(counts) for k in wanted}
    return {
        "avg": num_correct / num_samples,
        "stderr": stderr,
        "n": n,
        "num_problems": len(counts),
        "num_samples": num_samples,
        "num_correct": num_correct,
        "pass_at_k": pass_k,
        "per_problem": per_problem,
    }
