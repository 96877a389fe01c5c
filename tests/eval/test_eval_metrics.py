"""avg@n, standard error and unbiased pass@k against hand-computed values."""

from __future__ import annotations

import math

import pytest
from rlrecipe.eval.metrics import accuracy, mean_and_stderr, pass_at_k, per_problem_accuracy, summarize


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2) = 1/6
    (4, 2, 1, 0.5),
    (4, 0, 3, 0.0),
    (4, 4, 1, 1.0),
    (4, 1, 4, 1.0),  # n - c < k
    (5, 1, 2, 0.4),  # 1 - C(4,2)/C(5,2) = 1 - 6/10
    (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
    (32, 8, 1, 0.25),
    (32, 1, 16, 0.5),  # 1 - C(31,16)/C(32,16) = 1 - 16/32
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_large_n_is_stable():
    # 1 - C(n-c,k)/C(n,k) with n = 10_000: binomials far beyond float range
    assert pass_at_k(10_000, 1, 5_000) == pytest.approx(0.5, abs=1e-15)
    v = pass_at_k(10_000, 3, 1)
    assert v == pytest.approx(3e-4, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_accuracy_and_stderr():
    assert accuracy([True, False, False, True]) == 0.5
    assert per_problem_accuracy({"a": [True, True], "b": [False, True]}) == {"a": 1.0, "b": 0.5}
    m, se = mean_and_stderr([1.0, 0.5, 0.0])
    # std (ddof=1) of (1, .5, 0) = .5; se = .5 / sqrt(3)
    assert m == 0.5 and se == pytest.approx(0.5 / math.sqrt(3))
    assert mean_and_stderr([0.7]) == (0.7, 0.0)


def test_summarize_hand_computed():
    data = {
        "p1": [True, True, False, False],   # c = 2
        "p2": [True, False, False, False],  # c = 1
        "p3": [False, False, False, False],  # c = 0
    }
    s = summarize(data, ks=[1, 2, 8])
    assert s["n"] == 4 and s["num_problems"] == 3 and s["num_samples"] == 12 and s["num_correct"] == 3
    assert s["avg"] == pytest.approx(3 / 12)
    # per-problem means .5, .25, 0: mean .25, std (ddof=1) .25, se .25 / sqrt(3)
    assert s["stderr"] == pytest.approx(0.25 / math.sqrt(3))
    assert sorted(s["pass_at_k"]) == [1, 2, 4]  # 8 > n dropped, n always present
    assert s["pass_at_k"][1] == pytest.approx((0.5 + 0.25 + 0) / 3)
    # k=2: p1 1 - 1/6, p2 1 - C(3,2)/C(4,2) = 1/2, p3 0
    assert s["pass_at_k"][2] == pytest.approx((5 / 6 + 0.5 + 0) / 3)
    assert s["pass_at_k"][4] == pytest.approx(2 / 3)
    assert s["per_problem"] == {"p1": 0.5, "p2": 0.25, "p3": 0.0}


def test_summarize_single_problem_and_errors():
    s = summarize({"only": [True, False]}, ks=[1])
    assert s["stderr"] == 0.0 and s["avg"] == 0.5 and s["pass_at_k"] == {1: 0.5, 2: 1.0}
    with pytest.raises(ValueError):
        summarize({}, ks=[1])
    with pytest.raises(ValueError, match="'x'"):
        summarize({"x": []}, ks=[1])
