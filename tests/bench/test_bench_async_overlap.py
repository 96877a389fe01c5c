"""The CPU overlap benchmark's arithmetic and arms, on hand-made metrics rows (no timing is asserted)."""

from pathlib import Path

import pytest

from bench.async_overlap import ARMS, arm_overrides, compare, over_runs, summarise


def test_a_runs_step_is_its_wall_clock_after_the_first_step():
    rows = [{"step_wall_s": 30.0, "rollout_s": 9.0, "train_s": 9.0, "tokens_trained": 1}] + \
        [{"step_wall_s": 5.5, "rollout_s": 1.0, "rollout_collect_s": 3.0, "train_s": 2.0, "tokens_trained": 100}] * 3
    s = summarise(rows)
    # the wall clock, not rollout + train (3.0 here): what the run really took a step
    assert (s["step_s"], s["rollout_s"], s["train_s"], s["wait_s"]) == (5.5, 3.0, 2.0, 1.0)
    assert s["s_per_trained_token"] == pytest.approx(16.5 / 300)


def test_arms_over_repeats_and_their_paired_ratios_by_hand():
    def run(step):
        return {"step_s": step, "rollout_s": 2.0, "train_s": 2.0, "wait_s": 1.0, "s_per_trained_token": step / 100}

    shared = over_runs([run(4.0), run(5.0), run(6.0)])
    assert (shared["step_s"], shared["step_s_min"], shared["step_s_max"], shared["runs"]) == (5.0, 4.0, 6.0, 3)
    # round by round: shared 4, 5, 6 against async 2, 2.5, 4 -> 2.0, 2.0, 1.5 (not the arms' medians 5 / 2.5,
    # nor the fastest against the slowest)
    runs = {"shared": [run(4.0), run(5.0), run(6.0)], "split": [run(8.0), run(8.0), run(12.0)],
            "async": [run(2.0), run(2.5), run(4.0)]}
    out = compare({arm: over_runs(r) for arm, r in runs.items()}, runs)
    assert (out["async_vs_shared_per_step"], out["async_vs_shared_per_step_min"],
            out["async_vs_shared_per_step_max"], out["async_vs_shared_per_step_rounds"]) == (2.0, 1.5, 2.0, 3)
    assert out["async_vs_shared_per_trained_token"] == 2.0
    # split over async per round: 4, 3.2, 3 -> median 3.2; shared over split: 0.5, 0.625, 0.5
    assert (out["lag_async_over_split_per_step"], out["lag_async_over_split_per_step_min"],
            out["lag_async_over_split_per_step_max"]) == (3.2, 3.0, 4.0)
    assert out["placement_split_over_shared_per_step"] == 0.5
    assert out["split_step_over_rollout_plus_train"] == 2.0 and out["async_step_over_max_of_two"] == 2.5 / 2.0


def test_neighbouring_arms_differ_in_one_thing(tmp_path: Path):
    got = {arm: arm_overrides(tmp_path, arm, 0, 8) for arm in ARMS}

    def differing(a, b):
        (oa, ta, pa), (ob, tb, pb) = got[a], got[b]
        keys = {k for k in oa if k not in ("run.name", "rollout.sglang.base_port") and oa[k] != ob[k]}
        return keys, (ta, pa) != (tb, pb)

    # shared -> split: where the processes run and with how many threads (the server's pinning is part
    # of its launch command); nothing of the recipe else
    keys, placement = differing("shared", "split")
    assert keys == {"rollout.sglang.launch_cmd"} and placement
    # split -> async: the lag only
    assert differing("split", "async") == ({"rl.async_lag"}, False)
    assert all(o["rollout.engine"] == "sglang" and o["rollout.dtype"] == "float32" for o, _, _ in got.values())
