"""The CPU colocated-phase benchmark's arms and arithmetic, on hand-made metrics rows (no timing asserted)."""

from pathlib import Path

import pytest

from bench.colocated_phases import ARMS, arm_overrides, compare, summarise
from rlrecipe.rl.colocate import PHASES


def test_the_arms_differ_in_colocate_alone(tmp_path: Path):
    shared, colocated = (arm_overrides(tmp_path, arm, 0, 5) for arm in ARMS)
    differ = {k for k in shared if k not in ("run.name", "rollout.sglang.base_port") and shared[k] != colocated[k]}
    assert differ == {"rollout.colocate"} and colocated["rollout.colocate"] is True
    assert shared["rollout.sglang.weight_sync"] == "ipc" and "--enable-memory-saver" in shared[
        "rollout.sglang.launch_cmd"]


def _row(step: float, **phases: float) -> dict:
    return {"step_wall_s": step, "train_s": 1.0, "rollout_s": 2.0, **{f"colocate/{k}": v for k, v in phases.items()}}


def test_medians_after_the_first_step_and_the_hand_over_share_by_hand():
    phases = dict.fromkeys(PHASES, 0.1) | {"update_s": 0.9}
    run = summarise([_row(30.0, **phases), _row(4.0, **phases), _row(5.0, **phases), _row(6.0, **phases)])
    assert run["step_s"] == 5.0 and run["release_s"] == 0.1 and run["update_s"] == 0.9
    assert "release_s" not in summarise([_row(3.0), _row(4.0)])  # the shared arm has no phases
    shared = [summarise([_row(9.0), _row(4.0)]), summarise([_row(9.0), _row(5.0)]),
              summarise([_row(9.0), _row(7.0)])]
    colocated = [run, {**run, "step_s": 7.0}, {**run, "step_s": 7.0, "update_s": 2.0}]
    out = compare({"colocated": colocated, "shared": shared})
    assert out["colocated_step_s"] == 7.0 and out["shared_step_s"] == 5.0
    assert out["colocated_hand_over_s"] == pytest.approx(0.1 * (len(PHASES) - 1))
    assert out["colocated_hand_over_share_of_step"] == pytest.approx(0.1 * (len(PHASES) - 1) / 7.0)
    # round by round: 5 / 4, 7 / 5, 7 / 7 -> median 1.25 (the arms' medians would say 7 / 5 = 1.4)
    assert (out["colocated_step_over_shared"], out["colocated_step_over_shared_min"],
            out["colocated_step_over_shared_max"], out["colocated_step_over_shared_rounds"]) == (1.25, 1.0, 1.4, 3)
    # the colocated update against the same round's shared training (1.0 s each): 0.9, 0.9, 2.0
    assert (out["colocated_update_over_shared_train"], out["colocated_update_over_shared_train_max"]) == (0.9, 2.0)
    assert [r["colocated_step_over_shared"] for r in out["rounds"]] == [1.25, 1.4, 1.0]
