"""The simulated rollout engine, the cost model that times it, and both schedules run over it.

- `CostModel`: seconds of a decoding step as a function of its batch and the context it attends
  to, seconds of prefill per token, and (for the end to end figure) of training per token.
- `SimEngine`: a `RolloutEngine` with the real `generate()` contract (token budget, partial
  rollouts resuming, continuous batching over `max_batch` slots with refill) whose rows take
  the lengths of a real run (`Lengths`, bench/projection/lengths.py, with the prompt streams), and
  which advances a clock by the cost model instead of computing.
- `simulate`: the real pool logic (`RolloutPool`, through `bench.c3po_compare.run_steps`) run
  over it, synchronous and C3PO++ at the same tokens per step.

bench/projection/rollout.py reports and projects with these; bench/projection/calibration.py fits the
cost model to a measured run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from bench.c3po_compare import run_steps
from bench.projection.lengths import Lengths, ReplayStream, SyntheticStream
from rlrecipe.recipe.training import RLSection
from rlrecipe.rollout.base import Refill, RolloutEngine
from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.rollout.inprocess import EngineCounters
from rlrecipe.rollout.packed_attention import band_cells, decode_bands
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


@dataclass
class CostModel:
    """Seconds of rollout (and training) work, linear in what is done:

    decode step = step_s + row_s * rows in the batch + ctx_s * context tokens the rows attend to
    prefill call = prefill_call_s + prefill_token_s * tokens prefilled (identical sequences once)
                   + prefill_cell_s * rows x width of the cache it lays out (the in-process
                   engine's left-padded cache; 0 on a server's paged cache)
    refill = refill_cell_s * cache cells copied (the in-process engine's left-padded cache; 0 on a
             server's paged cache)
    training step = train_step_s + train_token_s * response tokens trained (+ push_s where the
                    projection does not cost the weight push on its own)
    """

    step_s: float
    row_s: float
    ctx_s: float
    prefill_call_s: float
    prefill_token_s: float
    prefill_cell_s: float = 0.0
    refill_cell_s: float = 0.0
    train_step_s: float = 0.0
    train_token_s: float = 0.0
    push_s: float = 0.0  # a weight push per step; bench.projection.asynchronous costs it with its own model
    label: str = ""

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))


# each cost parameter and the simulator counter it multiplies
FEATURES = {"step_s": "decode_steps", "row_s": "decode_rows", "ctx_s": "decode_cells",
            "prefill_call_s": "prefill_calls", "prefill_token_s": "prefill_tokens", "prefill_cell_s": "prefill_cells",
            "refill_cell_s": "refill_cells"}
# the groups of an engine's own split (seconds counters, and event phases) that calibrate fits
# separately with by="components" (per step) and by="events" (per prefill, decoding step, refill)
COMPONENTS = {("decode_s", "sample_s"): ("step_s", "row_s", "ctx_s"),
              ("prefill_s",): ("prefill_call_s", "prefill_token_s", "prefill_cell_s"),
              ("refill_s",): ("refill_cell_s",)}
PHASES = {"decode": ("step_s", "row_s", "ctx_s"), "prefill": ("prefill_call_s", "prefill_token_s", "prefill_cell_s"),
          "refill": ("refill_cell_s",)}


def rollout_seconds(cost: CostModel, counters: dict) -> float:
    return sum(getattr(cost, p) * counters.get(f, 0) for p, f in FEATURES.items())


# -- the simulated engine ---------------------------------------------------------------------
class SimEngine(RolloutEngine):
    """Schedules like a rollout engine and advances `clock` by `cost` instead of computing.

    layout "inprocess" is the in-process engine's schedule to the step (refill once a share
    `refill_fraction` of the slots is free; finished rows stay in the batch until compacting
    halves it; attention over the left-padded width; joining and compacting copy the cache).
    layout "server" is a server's continuous batching: a finished row leaves at once, a free slot
    is refilled at the next step, attention reads each row's own context, nothing is copied.
    With `kv_tokens` (its KV cache, in tokens) a server admits a newcomer only while the cache
    holds it beside the running rows, and when decoding outgrows the cache it retracts the
    running row with the fewest response tokens (SGLang's choice) back to the front of its queue,
    to be prefilled again, prompt and response so far, when there is room. `kv_reserve` is the
    share of each admitted row's tokens still to come (at most 4,096 a row, as SGLang clips its
    estimate) that admission keeps free: SGLang's new_token_ratio, which it moves between about
    0.1 and 0.7 as it goes; 0 admits on present contexts alone, which retracts the most.
    Each prefill runs the distinct prompt + response-so-far sequences of its newcomers.
    """

    def __init__(self, cost: CostModel, lengths: Lengths, *, eos_token_id: int = 2, max_batch: int | None = None,
                 refill_fraction: float = 0.25, layout: str = "server", version: int = 0,
                 kv_tokens: int | None = None, kv_reserve: float = 0.0):
        if layout not in ("server", "inprocess"):
            raise ValueError(f"layout: server or inprocess, not {layout!r}")
        if kv_tokens is not None and layout != "server":
            raise ValueError("kv_tokens: a server's KV cache (layout server)")
        self.cost, self.lengths, self.eos = cost, lengths, eos_token_id
        self.kv_tokens, self.kv_reserve = kv_tokens, kv_reserve
        self.max_batch = max_batch or 1 << 30
        self.refill_fraction, self.layout, self.version = refill_fraction, layout, version
        self.counters = EngineCounters()
        self.events: list | None = None  # as InProcessEngine.events: [phase, seconds, {counter: amount}]

    @property
    def forward_passes(self) -> int:
        return self.counters.forward_passes

    @property
    def clock(self) -> float:
        """Simulated seconds so far."""
        return self.counters.generate_s

    def update_weights_from_disk(self, model_dir, version: int) -> None:
        self.version = version

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        self.version = version

    def _spend(self, seconds: float, phase: str, work: dict) -> None:
        c = self.counters
        setattr(c, phase, getattr(c, phase) + seconds)
        c.generate_s += seconds
        if self.events is not None:
            self.events.append([phase[:-2], seconds, work])

    def _prefill(self, rows: list[Trajectory]) -> None:
        c, cost = self.counters, self.cost
        distinct: dict[tuple, list[Trajectory]] = {}  # (group, prompt, length so far) -> distinct sequences
        for t in rows:
            same = distinct.setdefault((t.group_id, tuple(t.prompt_ids), len(t.response_ids)), [])
            if not any(self.lengths.same_so_far(t, o) for o in same):
                same.append(t)
        tokens = sum(t.num_tokens for seqs in distinct.values() for t in seqs)
        cells = len(rows) * max(t.num_tokens for t in rows)
        c.forward_passes += 1
        c.prefill_calls += 1
        c.prefill_rows += len(rows)
        c.prefill_tokens += tokens
        c.prefill_cells += cells
        c.reprefill_tokens += sum(len(t.response_ids) for t in rows)
        self._spend(cost.prefill_call_s + cost.prefill_token_s * tokens + cost.prefill_cell_s * cells, "prefill_s",
                    {"prefill_calls": 1, "prefill_tokens": tokens, "prefill_cells": cells})

    def _copy(self, cache: list[int]) -> None:
        if self.layout == "inprocess":
            cells = len(cache) * max(cache)
            self.counters.refill_cells += cells
            self._spend(self.cost.refill_cell_s * cells, "refill_s", {"refill_cells": cells})

    def _decode(self, rows: list[Trajectory], cache: list[int]) -> None:
        c, cost = self.counters, self.cost
        for i in range(len(cache)):
            cache[i] += 1
        if self.layout == "inprocess":  # every row in the batch, over its band's width (rows longest first)
            batch = len(cache)
            cells = band_cells(decode_bands(sorted(cache, reverse=True)))
        else:  # the running rows, each over its own context
            running = [i for i, t in enumerate(rows) if t.status == Status.RUNNING]
            batch, cells = len(running), sum(cache[i] for i in running)
        c.forward_passes += 1
        c.decode_steps += 1
        c.decode_rows += batch
        c.decode_cells += cells
        self._spend(cost.step_s + cost.row_s * batch + cost.ctx_s * cells, "decode_s",
                    {"decode_steps": 1, "decode_rows": batch, "decode_cells": cells})

    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None,
                 refill: Refill | None = None) -> list[Trajectory]:
        # the same control flow as InProcessEngine.generate, with work counted instead of done
        queue = admit(trajs, params)[::-1]
        server = self.layout == "server"
        refill_at = 1 if server else max(1, int(self.refill_fraction * self.max_batch))
        budget = TokenBudget(token_budget)
        rows: list[Trajectory] = []
        cache: list[int] = []  # each row's cache length
        while queue or rows:
            live = [i for i, r in enumerate(rows) if r.status == Status.RUNNING]
            free = self.max_batch - len(live)
            take = min(free, len(queue)) if queue and (not live or free >= refill_at) else 0
            if take and self.kv_tokens is not None:
                used = sum(cache[i] + self._to_come(rows[i], params) for i in live)
                take = self._admissible(queue, take, used, not live, params)
            if take:
                new = [queue.pop() for _ in range(take)]
                self._prefill(new)
                rows = [rows[i] for i in live] + new
                cache = [cache[i] for i in live] + [t.num_tokens for t in new]
                if live:
                    self._copy(cache)
            elif len(live) < len(rows):
                if not live:
                    rows, cache = [], []
                    continue
                if server or len(live) <= len(rows) // 2:
                    rows, cache = [rows[i] for i in live], [cache[i] for i in live]
                    self._copy(cache)
            if server and not take and rows and not budget.reached and self._skip_quiet(rows, cache, params):
                continue
            ended = 0
            for t in rows:
                if t.status != Status.RUNNING:
                    continue
                eos_at = self.lengths.finish_at(t)
                ends = eos_at is not None and len(t.response_ids) + 1 >= eos_at
                token = self.lengths.token(t)
                t.append(self.eos if ends else token if token != self.eos else token + 1, 0.0, self.version)
                if ends:
                    t.status = Status.FINISHED
                elif len(t.response_ids) >= params.max_new_tokens:
                    t.status = Status.TRUNCATED
                ended += budget.count(t)
            if budget.reached:
                break
            if refill is not None and ended:
                queue[:0] = refill(ended)[::-1]  # fresh, behind those queued already (pop() takes the last)
            if any(r.status == Status.RUNNING for r in rows):
                if self.kv_tokens is not None:
                    rows, cache = self._retract(rows, cache, queue)
                self._decode(rows, cache)
            else:
                rows, cache = [], []
        return trajs

    def _skip_quiet(self, rows: list[Trajectory], cache: list[int], params: SamplingParams) -> bool:
        """Run at once the coming steps in which a server only decodes, when there are two or more:
        no row ends (its eos or max_new_tokens is further), none is admitted (the queue is empty or
        the batch full, or the KV cache holds no newcomer, which stays so while the rows grow) and none
        is retracted (the rows' next tokens still fit the cache). Each row takes the tokens, and
        the counters and clock the seconds, step by step as one step at a time would give them (the
        same sums in the same order), so a projection prints the same numbers, without a Python
        step per row and token (what took a 7B projection minutes). `rows`: all running."""
        if self.kv_tokens is not None and self.kv_reserve > 1:  # room kept per row would shrink as it grows
            return False
        batch, total = len(rows), sum(cache)
        k = min(self._steps_before_end(t, params) for t in rows)
        if self.kv_tokens is not None and batch > 1:  # step j retracts once total + j * batch + batch > kv
            k = min(k, (self.kv_tokens - total - batch) // batch + 1)
        if k < 2:
            return False
        for t in rows:
            tokens = [x if x != self.eos else x + 1 for x in self.lengths.tokens(t, k)]
            t.response_ids.extend(tokens)
            t.logp_infer.extend([0.0] * k)
            t.versions.extend([self.version] * k)
        for i in range(batch):
            cache[i] += k
        self._decode_steps(batch, total, k)
        return True

    def _steps_before_end(self, t: Trajectory, params: SamplingParams) -> int:
        """Steps `t` takes a token in without ending (at its eos or at max_new_tokens)."""
        eos_at = self.lengths.finish_at(t)
        end = params.max_new_tokens if eos_at is None else min(eos_at, params.max_new_tokens)
        return max(0, end - len(t.response_ids) - 1)

    def _decode_steps(self, batch: int, total: int, k: int) -> None:
        """`k` of `_decode`'s server steps over `batch` rows whose caches held `total` tokens before
        the first: the step's seconds added one step at a time, as `_spend` adds them."""
        c, cost = self.counters, self.cost
        decode_s, generate_s, cells_sum = c.decode_s, c.generate_s, 0
        for j in range(1, k + 1):
            cells = total + j * batch
            seconds = cost.step_s + cost.row_s * batch + cost.ctx_s * cells
            decode_s += seconds
            generate_s += seconds
            cells_sum += cells
            if self.events is not None:
                self.events.append(["decode", seconds, {"decode_steps": 1, "decode_rows": batch, "decode_cells": cells}])
        c.decode_s, c.generate_s = decode_s, generate_s
        c.forward_passes += k
        c.decode_steps += k
        c.decode_rows += batch * k
        c.decode_cells += cells_sum

    _RESERVE_CLIP = 4096  # SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION default

    def _to_come(self, t: Trajectory, params: SamplingParams) -> float:
        """KV room admission keeps for a row's tokens still to come (`kv_reserve`)."""
        if not self.kv_reserve:
            return 0.0
        return self.kv_reserve * min(params.max_new_tokens - len(t.response_ids), self._RESERVE_CLIP)

    def _admissible(self, queue: list[Trajectory], take: int, used: float, idle: bool,
                    params: SamplingParams) -> int:
        """How many of the next `take` queued rows the KV cache holds beside `used` tokens (each
        with room for its next token, and its reserve); one at least on an idle server, which
        must make progress."""
        n = 0
        while n < take:
            t = queue[-1 - n]
            need = t.num_tokens + 1 + self._to_come(t, params)
            if used + need > self.kv_tokens:
                break
            used += need
            n += 1
        return max(n, 1 if idle else 0)

    def _retract(self, rows: list[Trajectory], cache: list[int], queue: list[Trajectory]):
        """Before a decoding step: while the running rows' next tokens would not fit, the one with
        the fewest response tokens (the longest prompt among those) goes back to the queue's front."""
        running = [i for i, t in enumerate(rows) if t.status == Status.RUNNING]
        used = sum(cache[i] for i in running) + len(running)
        out = set()
        while used > self.kv_tokens and len(running) - len(out) > 1:
            i = min((i for i in running if i not in out),
                    key=lambda i: (len(rows[i].response_ids), -len(rows[i].prompt_ids)))
            out.add(i)
            used -= cache[i] + 1
            queue.append(rows[i])  # pop() takes it first
            self.counters.retracted_rows += 1
        if not out:
            return rows, cache
        keep = [i for i in range(len(rows)) if i not in out]
        return [rows[i] for i in keep], [cache[i] for i in keep]


# -- running schedules ------------------------------------------------------------------------
def _configs(settings: dict) -> tuple[RLSection, RLSection]:
    common = {"prompts_per_step": settings["prompts_per_step"], "samples_per_prompt": settings["samples_per_prompt"]}
    sync = RLSection(**common, c3po={"enabled": False})
    c3po = RLSection(**common, c3po={"enabled": True, "token_budget": settings["token_budget"],
                                     "pool_capacity": settings["pool_capacity"],
                                     "max_staleness": settings["max_staleness"],
                                     "refill": settings.get("refill", "per_call"),
                                     # runs recorded before surplus carry trained every finished rollout
                                     "surplus": settings.get("surplus", "train")})
    return sync, c3po


def _known(recorded: list[list]) -> dict[str, tuple[int, str]]:
    """uid -> (final length, status) of the trajectories a run finished; the others (still in flight
    or dropped when it ended) never finish within it."""
    return {uid: (n, status) if status in (Status.FINISHED.value, Status.TRUNCATED.value) else (1 << 30, "")
            for uid, _, _, n, status, *_ in recorded}


def _shared(recorded: list[list]) -> dict[str, dict[str, int]]:
    """uid -> {uid of an earlier member of its group: first response tokens they have in common}
    (-1: a different prompt)."""
    members: dict[str, list[str]] = {}
    out = {}
    for uid, gid, *rest in recorded:
        group = members.setdefault(gid, [])
        if len(rest) > 3:
            out[uid] = dict(zip(group, rest[3], strict=False))
        group.append(uid)
    return out


def simulate(trace: dict, cost: CostModel, *, layout: str | None = None, max_batch: int | None = None,
             groups: list | None = None, prompt_len: int | None = None) -> dict[str, list[dict]]:
    """Per-step records (as bench.c3po_compare.run_steps gives them, seconds simulated) of both modes.

    Replays the recorded trajectories' lengths (or, with `groups`, draws lengths from them and
    uses `prompt_len`-token prompts); `layout`/`max_batch` default to the recorded engine's."""
    settings = trace["settings"]
    layout = layout or settings.get("layout") or "server"
    max_batch = max_batch or settings.get("max_batch")
    params = SamplingParams(max_new_tokens=settings["max_new_tokens"])
    out = {}
    for mode, cfg in zip(("sync", "c3po"), _configs(settings), strict=True):
        recorded = trace["trajectories"][mode]
        if groups is None:
            lengths = Lengths(params.max_new_tokens, known=_known(recorded), shared=_shared(recorded))
            stream = ReplayStream(recorded)
        else:
            lengths = Lengths(params.max_new_tokens, groups=groups)
            stream = SyntheticStream(prompt_len or settings.get("prompt_len")
                                     or round(sum(r[2] for r in recorded) / len(recorded)))
        engine = SimEngine(cost, lengths, max_batch=max_batch, layout=layout,
                           refill_fraction=settings.get("refill_fraction") or 0.25,
                           kv_tokens=settings.get("kv_tokens") if layout == "server" else None,
                           kv_reserve=settings.get("kv_reserve") or 0.0)
        # as recorded: one uncounted step first (sets the budget, or fills the pool), then `steps`
        out[mode] = run_steps(engine, cfg, stream, params, settings["steps"] + 1, clock=lambda e=engine: e.clock)
        out[mode][0]["warmup"] = True
    return out
