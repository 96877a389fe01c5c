"""C3PO++'s per-call token budget, the one rule every engine and the rollout simulator follow.

A generate call continues the trajectories that can still grow (`admit`), counts the tokens of
each one that finishes, and stops as soon as those reach the budget Φ (`TokenBudget.reached`);
whatever is still running stays partial, to resume at the next step under newer weights. The
in-process engine, the SGLang client and bench/projection/sim.py's simulator all call these,
so a simulated schedule cannot drift from the engines'. Below both `c3po` and `rollout`: it knows
trajectories only.
"""

from __future__ import annotations

from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def admit(trajs: list[Trajectory], params: SamplingParams) -> list[Trajectory]:
    """The trajectories this call generates for, marked RUNNING, in the caller's order. Finished and
    aborted ones are left alone; one already at `max_new_tokens` is marked TRUNCATED instead."""
    out = []
    for t in trajs:
        if t.done or t.status == Status.ABORTED:
            continue
        t.status = Status.RUNNING
        if len(t.response_ids) >= params.max_new_tokens:
            t.status = Status.TRUNCATED
            continue
        out.append(t)
    return out


class TokenBudget:
    """Tokens of the trajectories finished in one call, against the budget (None: no budget)."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.finished_tokens = 0

    def count(self, t: Trajectory) -> bool:
        """Count `t` if it has just ended (finished or truncated); whether it had."""
        if not t.done:
            return False
        self.finished_tokens += len(t.response_ids)
        return True

    @property
    def reached(self) -> bool:
        return self.budget is not None and self.finished_tokens >= self.budget
