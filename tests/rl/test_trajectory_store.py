"""The array checkpoint of trajectories: every field back, float32 log-probs, clear error on damage."""

import numpy as np
import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.trajectory.record import Status, Trajectory
from rlrecipe.trajectory.store import load_trajectories, save_trajectories


def _trajs():
    a = Trajectory(uid="p1#0", prompt_ids=[5, 6, 7], group_id="p1", answers=["12", "\\frac{1}{2}"],
                   response_ids=[8, 9], logp_infer=[-0.1, -2.718281828459045], versions=[3, 4],
                   status=Status.FINISHED, reward=5.0, correct=True, age=1, meta={"source": "é"})
    b = Trajectory(uid="p2#1", prompt_ids=[1], group_id="p2", status=Status.RUNNING)  # nothing generated yet
    c = Trajectory(uid="p3#0", prompt_ids=[2, 2], response_ids=[70000], logp_infer=[-30.5], versions=[0],
                   status=Status.TRUNCATED, reward=-5.0, correct=False)
    return [a, b, c]


def test_round_trip(tmp_path):
    path = tmp_path / "pool.safetensors"
    save_trajectories(path, _trajs(), {"cursor": 17})
    back, extra = load_trajectories(path)
    assert extra == {"cursor": 17}
    for got, want in zip(back, _trajs(), strict=True):
        expected = want.to_dict()
        expected["logp_infer"] = [float(np.float32(x)) for x in want.logp_infer]
        assert got.to_dict() == expected
    assert back[1].reward is None and back[1].correct is None and back[1].response_ids == []
    assert not list(tmp_path.glob("*.tmp"))


def test_empty_pool(tmp_path):
    save_trajectories(tmp_path / "p.safetensors", [])
    assert load_trajectories(tmp_path / "p.safetensors") == ([], {})


def test_damaged_file_names_itself(tmp_path):
    path = tmp_path / "pool.safetensors"
    save_trajectories(path, _trajs())
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match="pool.safetensors: not a readable trajectory file"):
        load_trajectories(path)
