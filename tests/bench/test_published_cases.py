"""Every published case (bench/data/published/) predicted by the simulator within the bound its file states."""

import json

import pytest

from bench.projection.published import CASES, all_cases, fit, load, predict
from rlrecipe.checks import gpu_costs as gc

FILES = sorted(CASES.glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_case_is_predicted_within_its_bound(path):
    case = load(path)
    for key in ("source", "reported", "setup", "bound", "bound_reason"):
        assert case[key], key
    row = predict(case)
    assert row["within"], (f"{case['id']}: predicted {row['predicted']:.4g} against {row['reported']:g}, "
                           f"error {row['error']:+.1%} past its bound {case['bound']:.0%}")


def test_the_ratio_cases_keep_the_ratio_bound_unless_a_reason_is_written():
    for case in all_cases():
        if case["kind"] == "rl_speedup" and case["bound"] > 0.15:
            assert "miss" in case["bound_reason"] and "leaves out" in case["bound_reason"], case["id"]
        if case["kind"] != "rl_speedup":
            assert case["bound"] <= 0.25, case["id"]


def test_the_shipped_shares_are_the_fit():
    got = fit()
    assert got["decode_share"] == pytest.approx(gc.DECODE_SHARE, abs=5e-4)
    assert got["train_share"] == pytest.approx(gc.TRAIN_SHARE, abs=5e-4)
    for name, residual in got["residuals"].items():
        assert residual == pytest.approx(gc.FIT_RESIDUALS[name], abs=5e-4), name
    json.dumps(got)
