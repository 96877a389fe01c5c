"""One guard for both training stages: a run stops after `limit` steps in a row whose update the
engine skipped for a NaN/inf loss or gradient, rather than training on nothing and ending in exit 0."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from rlrecipe.core.errors import UserError


class BadStepGuard:
    def __init__(self, limit: int, stage: str, was_skipped: Callable[[dict], bool]):
        """`was_skipped(stats)`: the step's logged stats say its update was skipped."""
        self.limit, self.stage, self.was_skipped = limit, stage, was_skipped
        self.in_a_row = 0

    def resume(self, rows: Iterable[dict]) -> None:
        """The count as it stood after these steps' logged stats (a resumed run's, in order)."""
        self.in_a_row = 0
        for row in rows:
            self.in_a_row = self.in_a_row + 1 if self.was_skipped(row) else 0

    def check(self, stats: dict, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if self.was_skipped(stats) else 0
        if self.in_a_row >= self.limit:
            raise UserError(f"{self.stage} step {step}: loss or gradient was NaN/inf in {self.in_a_row} steps in a "
                            "row; lower trainer.lr or check the data")


def sft_step_skipped(stats: dict) -> bool:
    return bool(stats.get("skipped"))


def rl_step_skipped(stats: dict) -> bool:
    """Every minibatch of the step's PPO update was skipped."""
    return stats["skipped_minibatches"] == stats["minibatches"]
