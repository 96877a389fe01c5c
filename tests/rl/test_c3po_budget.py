"""C3PO++'s budget rule, the one both engines and the simulator call."""

from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def _traj(uid: str, n: int, status: Status = Status.RUNNING) -> Trajectory:
    t = Trajectory(uid=uid, prompt_ids=[1, 2])
    for _ in range(n):
        t.append(7, -0.5, 0)
    t.status = status
    return t


def test_admit_continues_what_can_grow_in_order_and_truncates_what_cannot():
    trajs = [_traj("a", 0), _traj("done", 3, Status.FINISHED), _traj("b", 2, Status.RUNNING),
             _traj("aborted", 1, Status.ABORTED), _traj("full", 4), _traj("c", 1, Status.TRUNCATED)]
    out = admit(trajs, SamplingParams(max_new_tokens=4))
    assert [t.uid for t in out] == ["a", "b"]
    assert all(t.status == Status.RUNNING for t in out)
    assert [t.status for t in trajs[1:]] == [Status.FINISHED, Status.RUNNING, Status.ABORTED, Status.TRUNCATED,
                                            Status.TRUNCATED]


def test_budget_counts_ended_trajectories_only_and_is_reached_at_phi():
    budget = TokenBudget(10)
    running, finished, truncated = _traj("r", 9, Status.RUNNING), _traj("f", 6, Status.FINISHED), \
        _traj("t", 4, Status.TRUNCATED)
    assert budget.count(running) is False and budget.finished_tokens == 0
    assert budget.count(finished) is True and not budget.reached
    assert budget.count(truncated) is True and budget.finished_tokens == 10 and budget.reached


def test_no_budget_is_never_reached():
    budget = TokenBudget(None)
    budget.count(_traj("f", 10**6, Status.FINISHED))
    assert not budget.reached
