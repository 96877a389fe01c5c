"""What a step's rollout reports: the pool's counts, dynamic sampling's tally, and what the RL stage
adds once the batch is graded; `metrics()` is the log's view of it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DynamicTally:
    """One step's dynamic sampling (DAPO): groups judged, with signal, dropped, let through past the cap."""

    judged: int = 0
    signal: int = 0
    dropped: int = 0
    dropped_tokens: int = 0
    over_cap: int = 0  # groups without signal that trained because the step had dropped its cap
    prompts_drawn: int = 0
    extra_prompts: int = 0
    held: int | None = None  # under C3PO++: finished rollouts waiting for the rest of their group
    collect_s: float | None = None  # generation and grading of the judged groups together

    def metrics(self) -> dict[str, float]:
        out = {"ds_groups_judged": self.judged, "ds_groups_dropped": self.dropped, "ds_groups_over_cap": self.over_cap,
               "ds_dropped_tokens": self.dropped_tokens, "ds_signal_share": self.signal / max(1, self.judged),
               "ds_prompts_drawn": self.prompts_drawn, "ds_extra_prompts": self.extra_prompts,
               "ds_cap_hit": float(self.over_cap > 0)}
        if self.held is not None:
            out["ds_held"] = self.held
        if self.collect_s is not None:
            out["ds_collect_s"] = self.collect_s
        return out


@dataclass
class RolloutStats:
    """A step's rollout: what the pool did, and what rank 0 adds once the batch is graded."""

    generated_tokens: int = 0
    finished: int = 0
    resumed: int = 0
    dropped: int = 0
    pool_size: int = 0
    mean_age: float = 0.0
    max_age: int = 0
    carried: int = 0  # finished past the budget, left to train next step
    partial_group_responses: int = 0  # trained responses whose group is not whole in the batch
    dynamic: DynamicTally | None = None  # with rl.dynamic_sampling only
    # added by the RL stage once the batch is graded
    graded: int = 0
    grade_s: float = 0.0
    dropped_total: int = 0
    resumed_total: int = 0
    prompts_skipped_too_long: int = 0
    overlong_penalty_mean: float | None = None  # with rl.overlong.cache only
    engine: dict[str, float] = field(default_factory=dict)  # the engine's own counters (its fleet's)

    def metrics(self) -> dict[str, float]:
        out = {"tokens_generated": self.generated_tokens, "pool_size": self.pool_size, "pool_mean_age": self.mean_age,
               "pool_max_age": self.max_age, "dropped": self.dropped, "resumed": self.resumed, "carried": self.carried,
               "partial_group_responses": self.partial_group_responses,
               **(self.dynamic.metrics() if self.dynamic is not None else {}),
               "dropped_total": self.dropped_total, "resumed_total": self.resumed_total,
               "prompts_skipped_too_long": self.prompts_skipped_too_long, "graded": self.graded,
               "grade_s": self.grade_s, **self.engine}  # grade_s is part of rollout_s
        if self.overlong_penalty_mean is not None:
            out["overlong_penalty_mean"] = self.overlong_penalty_mean
        return out

    @classmethod
    def from_dict(cls, d: dict) -> RolloutStats:
        """Back from `dataclasses.asdict` (a checkpoint's batches collected ahead)."""
        dynamic = d.get("dynamic")
        return cls(**{**d, "dynamic": DynamicTally(**dynamic) if dynamic is not None else None})
