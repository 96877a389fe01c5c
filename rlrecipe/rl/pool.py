"""C3PO++: the budget-controlled rollout pool, and the synchronous baseline it replaces.

Each step the engine generates over a pool of in-flight trajectories (capacity Omega) until the
trajectories that finished hold Phi tokens; those are trained on. Unfinished ones stay in the
pool, resume next step under the new weights (each token keeps its own logp_infer and
version), and age by one per step; one older than sigma steps is dropped. New prompts, each
sampled n times as a group, refill the pool: before each generate call, or (`refill:
continuous`) during it, as soon as n rollouts have finished.

Rollouts that end on the decoding step that reaches Phi all finish at once. With `surplus:
carry` the step trains the oldest of them (pool order: carried, then resumed, then fresh) until
Phi is reached, and the others wait, finished, to train first next step (fewer than Phi tokens of
them: the next step must still generate), so a step trains between Phi and Phi plus one rollout
unless a single decoding step finished more than 2 Phi. Waiting rollouts age like unfinished
ones and obey the same sigma.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.core.seeds import GENERATE_ROUND, PROMPT_EPOCH, mix_seed
from rlrecipe.data.templates import row_prompt_ids
from rlrecipe.recipe.training import RLSection
from rlrecipe.rollout.base import RolloutEngine
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory
from rlrecipe.trajectory.store import load_trajectories, save_trajectories


class PromptStream:
    """Endless, seeded, epoch-shuffled stream of RL prompts; its cursor is checkpointed."""

    def __init__(self, rows: list[dict], tokenizer, template: str, seed: int, shuffle: bool = True,
                 max_prompt_tokens: int | None = None):
        """A prompt longer than `max_prompt_tokens` (after the template) is left out and counted in
        `skipped_too_long`, as AReaL filters its RL set by prompt length when loading it."""
        self.tokenizer, self.template = tokenizer, template
        self.rows, self.skipped_too_long = rows, 0
        if max_prompt_tokens is not None:
            self.rows = [r for r in rows if len(row_prompt_ids(tokenizer, r, template)) <= max_prompt_tokens]
            self.skipped_too_long = len(rows) - len(self.rows)
            if rows and not self.rows:
                raise UserError(f"data.max_prompt_tokens: all {len(rows)} prompts are longer than "
                                f"{max_prompt_tokens} tokens")
        self.seed, self.shuffle = seed, shuffle
        self.cursor = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(mix_seed(self.seed, epoch, PROMPT_EPOCH)).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next_group(self, n: int) -> list[Trajectory]:
        epoch, i = divmod(self.cursor, len(self.rows))
        row = self.rows[self._epoch_order(epoch)[i]]
        self.cursor += 1
        prompt = row_prompt_ids(self.tokenizer, row, self.template)
        gid = f"{row['id']}@{self.cursor - 1}"
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=prompt, group_id=gid, answers=list(row["answers"]))
                for j in range(n)]


@dataclass
class RolloutStats:
    generated_tokens: int = 0
    finished: int = 0
    resumed: int = 0
    dropped: int = 0
    pool_size: int = 0
    mean_age: float = 0.0
    max_age: int = 0
    carried: int = 0  # finished past the budget, left to train next step
    extra: dict = field(default_factory=dict)


def within_budget(finished: list[Trajectory], budget: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """Split `finished` (oldest first) into what trains now and what waits for the next step.

    Now: the first until they hold `budget` response tokens (the one that reaches it included).
    Waiting: the rest, as long as they hold fewer than `budget` tokens; past that, the oldest of
    them train now too, so the next step still has a budget left to generate for (otherwise its
    unfinished rollouts would age a step without a token)."""
    total = 0
    cut = len(finished)
    for i, t in enumerate(finished):
        if total >= budget:
            cut = i
            break
        total += len(t.response_ids)
    waiting = sum(len(t.response_ids) for t in finished[cut:])
    while waiting >= budget:
        waiting -= len(finished[cut].response_ids)
        cut += 1
    return finished[:cut], finished[cut:]


class RolloutPool:
    """Owns the in-flight trajectories between steps (saved in checkpoints)."""

    def __init__(self, cfg: RLSection, stream: PromptStream):
        self.cfg = cfg
        self.stream = stream
        self.in_flight: list[Trajectory] = []
        self.carried: list[Trajectory] = []  # finished past an earlier step's budget, not trained yet
        self.total_dropped = 0
        self.total_resumed = 0

    def _tokens(self, trajs: list[Trajectory]) -> int:
        return sum(len(t.response_ids) for t in trajs)

    def collect(self, engine: RolloutEngine, params: SamplingParams, seed: int) -> tuple[list[Trajectory], RolloutStats]:
        if self.cfg.c3po.enabled:
            return self._collect_budgeted(engine, params, seed)
        return self._collect_synchronous(engine, params, seed)

    def _collect_synchronous(self, engine, params, seed):
        batch = [t for _ in range(self.cfg.prompts_per_step) for t in self.stream.next_group(self.cfg.samples_per_prompt)]
        engine.generate(batch, params, seed=seed)
        stats = RolloutStats(generated_tokens=self._tokens(batch), finished=len(batch), pool_size=len(batch))
        return batch, stats

    def _collect_budgeted(self, engine, params, seed):
        c3 = self.cfg.c3po
        stats = RolloutStats()
        # Stale rollouts are dropped before they can waste more compute, and finished ones still
        # waiting before they train on tokens more than sigma policies old.
        self.in_flight = self._drop_stale(self.in_flight, stats)
        carried = self._drop_stale(self.carried, stats)
        stats.resumed = len(self.in_flight)
        before = {t.uid: len(t.response_ids) for t in self.in_flight}
        finished: list[Trajectory] = list(carried)  # they count toward this budget first
        round_ = 0
        n = self.cfg.samples_per_prompt
        while self._tokens(finished) < c3.token_budget:
            while len(self.in_flight) + n <= max(c3.pool_capacity, n):
                self.in_flight += self.stream.next_group(n)
            refill = self._refill_as_finished(n) if c3.refill == "continuous" else None
            engine.generate(self.in_flight, params, token_budget=c3.token_budget - self._tokens(finished),
                            seed=mix_seed(seed, round_, GENERATE_ROUND), refill=refill)
            round_ += 1
            finished += [t for t in self.in_flight if t.done]
            self.in_flight = [t for t in self.in_flight if not t.done]
        new = finished[len(carried):]
        stats.generated_tokens = sum(len(t.response_ids) - before.get(t.uid, 0) for t in new + self.in_flight)
        self.total_resumed += sum(1 for t in new if t.uid in before)
        if c3.surplus == "carry":
            finished, self.carried = within_budget(finished, c3.token_budget)
        else:
            self.carried = []
        for t in self.in_flight + self.carried:
            t.age += 1
        stats.finished = len(finished)
        stats.carried = len(self.carried)
        stats.pool_size = len(self.in_flight)
        ages = [t.age for t in self.in_flight] or [0]
        stats.mean_age, stats.max_age = sum(ages) / len(ages), max(ages)
        self.total_dropped += stats.dropped
        return finished, stats

    def _drop_stale(self, trajs: list[Trajectory], stats: RolloutStats) -> list[Trajectory]:
        kept = []
        for t in trajs:
            if t.age > self.cfg.c3po.max_staleness:
                t.status = Status.ABORTED
                stats.dropped += 1
            else:
                kept.append(t)
        return kept

    def _refill_as_finished(self, n: int):
        """The engine's `refill` for one generate call: finished rollouts free their slots, and a
        new group of n starts whenever n slots are free, so at most Omega are ever in flight."""
        free = max(self.cfg.c3po.pool_capacity, n) - len(self.in_flight)

        def refill(finished: int) -> list[Trajectory]:
            nonlocal free
            free += finished
            new: list[Trajectory] = []
            while free >= n:
                new += self.stream.next_group(n)
                free -= n
            self.in_flight = self.in_flight + new  # a new list: the engine's own `trajs` stays as given
            return new

        return refill

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"cursor": self.stream.cursor, "in_flight": [t.to_dict() for t in self.in_flight],
                "carried": [t.to_dict() for t in self.carried],
                "total_dropped": self.total_dropped, "total_resumed": self.total_resumed}

    def load_state_dict(self, state: dict) -> None:
        self.stream.cursor = state["cursor"]
        self.in_flight = [Trajectory.from_dict(d) for d in state["in_flight"]]
        self.carried = [Trajectory.from_dict(d) for d in state.get("carried", [])]  # absent before surplus carry
        self.total_dropped = state["total_dropped"]
        self.total_resumed = state["total_resumed"]

    def save(self, path: str | Path) -> None:
        """The rollouts in the pool as arrays (safetensors), the counters beside them; the carried
        ones are those finished (their status tells them apart)."""
        save_trajectories(path, self.in_flight + self.carried,
                          {"cursor": self.stream.cursor, "total_dropped": self.total_dropped,
                           "total_resumed": self.total_resumed})

    def load(self, path: str | Path) -> None:
        trajs, extra = load_trajectories(path)
        self.in_flight = [t for t in trajs if not t.done]
        self.carried = [t for t in trajs if t.done]
        self.stream.cursor = extra["cursor"]
        self.total_dropped = extra["total_dropped"]
        self.total_resumed = extra["total_resumed"]
