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

A group baseline (rl.adv_norm group, group_mean, group_quantile: GRPO, Dr. GRPO, QAE) is computed
over the group in the batch, so under C3PO++ such a step trains whole groups only: a finished
rollout waits (held) until every member of its group has finished, and the group counts toward Phi,
is carried and trains as one. A member trained alone would get advantage 0, and the others a
baseline from part of their group.

Dynamic sampling (rl.dynamic_sampling, DAPO) judges whole groups the same way: a complete group is
graded, and one whose samples are all right or all wrong is dropped; only groups with signal count
toward Phi, and the surplus is carried whole groups at a time. A group's members enter together and age together, so
sigma drops a group whole and a dropped group never leaves partial rollouts behind. Synchronous
steps draw new groups for the dropped ones. Either way at most `max_extra_prompts` groups are
dropped a step; past that they train (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlrecipe.algo.advantages import GROUP_MODES
from rlrecipe.algo.dapo import group_has_signal
from rlrecipe.core.seeds import DYNAMIC_ROUND, GENERATE_ROUND, mix_seed
from rlrecipe.recipe.training import RLSection
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rl.rollout_stats import DynamicTally, RolloutStats
from rlrecipe.rollout.base import RolloutEngine
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory
from rlrecipe.trajectory.store import load_trajectories, save_trajectories


def _split_at_budget(units: list, size: Callable, budget: int) -> tuple[list, list]:
    total = 0
    cut = len(units)
    for i, u in enumerate(units):
        if total >= budget:
            cut = i
            break
        total += size(u)
    waiting = sum(size(u) for u in units[cut:])
    while waiting >= budget:
        waiting -= size(units[cut])
        cut += 1
    return units[:cut], units[cut:]


def within_budget(finished: list[Trajectory], budget: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """Split `finished` (oldest first) into what trains now and what waits for the next step.

    Now: the first until they hold `budget` response tokens (the one that reaches it included).
    Waiting: the rest, as long as they hold fewer than `budget` tokens; past that, the oldest of
    them train now too, so the next step still has a budget left to generate for (otherwise its
    unfinished rollouts would age a step without a token)."""
    return _split_at_budget(finished, lambda t: len(t.response_ids), budget)


def groups_within_budget(finished: list[Trajectory], budget: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """`within_budget` a whole group at a time (`finished` holds whole groups, each together)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in finished:
        groups.setdefault(t.group_id, []).append(t)
    now, later = _split_at_budget(list(groups.values()), lambda g: sum(len(t.response_ids) for t in g), budget)
    return [t for g in now for t in g], [t for g in later for t in g]


Judge = Callable[[list[Trajectory]], None]  # grades trajectories in place (sets correct and reward)


def partial_group_responses(batch: list[Trajectory], group_size: int) -> int:
    """How many of a batch's responses come from a group with fewer than `group_size` members in it."""
    sizes: dict[str, int] = {}
    for t in batch:
        sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
    return sum(1 for t in batch if sizes[t.group_id] < group_size)


class DynamicCount:
    """One step's dynamic-sampling tally: groups judged, with signal, dropped, let through past the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.judged = self.signal = self.dropped = self.dropped_tokens = self.let_through = 0

    def keeps(self, group: list[Trajectory]) -> bool:
        """Whether `group` (graded) trains: it has signal, or this step has dropped `cap` already."""
        self.judged += 1
        if group_has_signal([bool(t.correct) for t in group]):
            self.signal += 1
            return True
        if self.dropped < self.cap:
            self.dropped += 1
            self.dropped_tokens += sum(len(t.response_ids) for t in group)
            return False
        self.let_through += 1
        return True

    def tally(self, prompts_drawn: int, extra_prompts: int, held: int | None = None) -> DynamicTally:
        return DynamicTally(self.judged, self.signal, self.dropped, self.dropped_tokens, self.let_through,
                            prompts_drawn, extra_prompts, held)


class RolloutPool:
    """Owns the in-flight trajectories between steps (saved in checkpoints)."""

    def __init__(self, cfg: RLSection, stream: PromptStream):
        self.cfg = cfg
        self.stream = stream
        self.in_flight: list[Trajectory] = []
        self.carried: list[Trajectory] = []  # finished past an earlier step's budget, not trained yet
        self.held: list[Trajectory] = []  # whole groups only: finished, waiting for the rest of their group
        self.total_dropped = 0
        self.total_resumed = 0

    @property
    def dynamic(self) -> bool:
        return self.cfg.dynamic_sampling.enabled

    @property
    def whole_groups(self) -> bool:
        """Whether each step trains whole groups only (dynamic sampling, or a group baseline)."""
        return self.dynamic or self.cfg.adv_norm in GROUP_MODES

    def _dynamic_cap(self) -> int:
        cap = self.cfg.dynamic_sampling.max_extra_prompts
        return self.cfg.prompts_per_step if cap is None else cap

    def _tokens(self, trajs: list[Trajectory]) -> int:
        return sum(len(t.response_ids) for t in trajs)

    def collect(self, engine: RolloutEngine, params: SamplingParams, seed: int,
                judge: Judge | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """A step's batch. With dynamic sampling, `judge` grades the groups as they complete."""
        if self.dynamic and judge is None:
            raise ValueError("rl.dynamic_sampling needs a judge to grade groups while collecting")
        if self.cfg.c3po.enabled and self.whole_groups:
            batch, stats = self._collect_budgeted_groups(engine, params, seed, judge if self.dynamic else None)
        elif self.cfg.c3po.enabled:
            batch, stats = self._collect_budgeted(engine, params, seed)
        elif self.dynamic:
            batch, stats = self._collect_synchronous_dynamic(engine, params, seed, judge)
        else:
            batch, stats = self._collect_synchronous(engine, params, seed)
        stats.partial_group_responses = partial_group_responses(batch, self.cfg.samples_per_prompt)
        return batch, stats

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

    def _collect_synchronous_dynamic(self, engine, params, seed, judge: Judge):
        """prompts_per_step groups with signal: the dropped ones are replaced by new groups, in
        rounds, until none is missing or `max_extra_prompts` extra groups were drawn; then the
        groups dropped last fill what is missing (they were generated already)."""
        n, want = self.cfg.samples_per_prompt, self.cfg.prompts_per_step
        count = DynamicCount(cap=want * (self._dynamic_cap() + 1))  # never reached: the cap bounds the draws
        cursor0, cap = self.stream.cursor, self._dynamic_cap()
        kept: list[list[Trajectory]] = []
        spare: list[list[Trajectory]] = []
        groups = [self.stream.next_group(n) for _ in range(want)]
        generated = extra = round_ = 0
        while True:
            flat = [t for g in groups for t in g]
            # round 0 samples exactly as a step without dynamic sampling
            engine.generate(flat, params, seed=seed if round_ == 0 else mix_seed(seed, round_, DYNAMIC_ROUND))
            generated += self._tokens(flat)
            judge(flat)
            for g in groups:
                (kept if count.keeps(g) else spare).append(g)
            missing, room = want - len(kept), cap - extra
            if missing == 0 or room == 0:
                break
            round_ += 1
            groups = [self.stream.next_group(n) for _ in range(min(missing, room))]
            extra += len(groups)
        filled = spare[len(spare) - missing:] if missing else []
        count.dropped -= len(filled)
        count.dropped_tokens -= sum(self._tokens(g) for g in filled)
        count.let_through = len(filled)
        batch = [t for g in kept + filled for t in g]
        stats = RolloutStats(generated_tokens=generated, finished=len(batch), pool_size=len(batch))
        stats.dynamic = count.tally(self.stream.cursor - cursor0, extra)
        return batch, stats

    def _collect_budgeted_groups(self, engine, params, seed, judge: Judge | None):
        """C3PO++ over whole groups: a finished rollout is held until its group has finished; with
        dynamic sampling (`judge`) a complete group is graded and, without signal, dropped (at most
        `max_extra_prompts` a step); the step ends when the groups kept hold Phi tokens. The
        engine's per-call budget is what the kept groups still lack, so dropped and held tokens
        make the step generate on."""
        c3, n = self.cfg.c3po, self.cfg.samples_per_prompt
        stats = RolloutStats()
        count = DynamicCount(self._dynamic_cap()) if judge is not None else None
        cursor0 = self.stream.cursor
        self.in_flight = self._drop_stale(self.in_flight, stats)
        self.held = self._drop_stale(self.held, stats)
        ready = self._drop_stale(self.carried, stats)  # whole groups, judged, count toward Phi first
        stats.resumed = len(self.in_flight)
        start = {t.uid: len(t.response_ids) for t in self.in_flight + self.held + ready}
        seen: list[Trajectory] = []  # every rollout that ended this step
        round_ = 0
        while self._tokens(ready) < c3.token_budget:
            while len(self.in_flight) + n <= max(c3.pool_capacity, n):
                self.in_flight += self.stream.next_group(n)
            refill = self._refill_as_finished(n) if c3.refill == "continuous" else None
            engine.generate(self.in_flight, params, token_budget=c3.token_budget - self._tokens(ready),
                            seed=mix_seed(seed, round_, GENERATE_ROUND), refill=refill)
            round_ += 1
            ended = [t for t in self.in_flight if t.done]
            seen += ended
            self.in_flight = [t for t in self.in_flight if not t.done]
            ready += self._complete_groups(ended, judge, count)
        stats.generated_tokens = sum(len(t.response_ids) - start.get(t.uid, 0) for t in seen + self.in_flight)
        self.total_resumed += sum(1 for t in seen if t.uid in start)
        if c3.surplus == "carry":
            ready, self.carried = groups_within_budget(ready, c3.token_budget)
        else:
            self.carried = []
        for t in self.in_flight + self.held + self.carried:
            t.age += 1
        stats.finished = len(ready)
        stats.carried = len(self.carried)
        stats.pool_size = len(self.in_flight)
        ages = [t.age for t in self.in_flight] or [0]
        stats.mean_age, stats.max_age = sum(ages) / len(ages), max(ages)
        self.total_dropped += stats.dropped
        if count is not None:
            stats.dynamic = count.tally(self.stream.cursor - cursor0, count.dropped, held=len(self.held))
        return ready, stats

    def _complete_groups(self, ended: list[Trajectory], judge: Judge | None,
                         count: DynamicCount | None) -> list[Trajectory]:
        """The rollouts of the groups `ended` completed that train (graded where judged); the others
        stay held."""
        self.held += ended
        running = {t.group_id for t in self.in_flight}
        complete: dict[str, list[Trajectory]] = {}
        still: list[Trajectory] = []
        for t in self.held:
            if t.group_id in running:
                still.append(t)
            else:
                complete.setdefault(t.group_id, []).append(t)
        self.held = still
        if not complete:
            return []
        if judge is None:
            return [t for g in complete.values() for t in g]
        judge([t for g in complete.values() for t in g])
        return [t for g in complete.values() if count.keeps(g) for t in g]

    def _drop_stale(self, trajs: list[Trajectory], stats: RolloutStats) -> list[Trajectory]:
        kept = []
        for t in trajs:
            if t.age > self.cfg.rollout_age_limit:
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
    def save(self, path: str | Path) -> None:
        """The rollouts in the pool as arrays (safetensors), the counters beside them; the carried
        ones are those finished (their status tells them apart), and with dynamic sampling the
        held ones are the finished rollouts of the groups not yet whole."""
        extra = {"cursor": self.stream.cursor, "total_dropped": self.total_dropped, "total_resumed": self.total_resumed}
        if self.held:
            extra["held"] = [t.uid for t in self.held]
        save_trajectories(path, self.in_flight + self.carried + self.held, extra)

    def load(self, path: str | Path) -> None:
        trajs, extra = load_trajectories(path)
        held = set(extra.get("held", []))
        self.in_flight = [t for t in trajs if not t.done]
        self.carried = [t for t in trajs if t.done and t.uid not in held]
        self.held = [t for t in trajs if t.uid in held]
        self.stream.cursor = extra["cursor"]
        self.total_dropped = extra["total_dropped"]
        self.total_resumed = extra["total_resumed"]
