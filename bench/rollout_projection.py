"""C3PO++ vs synchronous rollout projected to a device where it matters, from a measured run.

On a GPU a decoding step costs about the same at batch 8 and batch 256 (reading the weights
dominates), so a synchronous step that waits for its longest rollouts wastes the device; on the
CPUs `make bench` runs on, a step's cost grows with its batch, and that waste is small. This
module times the same rollout schedules with an explicit device cost model instead of a device:

- `CostModel`: seconds of a decoding step as a function of its batch and the context it attends
  to, seconds of prefill per token, and (for the end to end figure) of training per token. The
  default is an ASSUMPTION (a 7B model in bf16 on one H100, derived below), loadable from JSON.
- `SimEngine`: a `RolloutEngine` with the real `generate()` contract (token budget, partial
  rollouts resuming, continuous batching over `max_batch` slots with refill) whose rows take
  the lengths of a real run, and which advances a clock by the cost model instead of computing.
- `project`: the real pool logic (`RolloutPool`) run over it, synchronous and C3PO++ at the same
  tokens per step, replaying a run that `bench.c3po_compare` recorded (every trajectory's prompt
  and response length): seconds per step and per trained token, speed-ups, where the seconds go.
- `calibrate`: least-squares (non-negative) fit of the cost model from the measured per-step
  seconds of such a run against the simulator's features for the same schedule: from
  `make bench-sglang` output on a GPU, or from `make bench` on CPU, where the calibrated
  projection should come back to the measured CPU ratio (a check of the simulator).

    python -m bench.rollout_projection bench/c3po_server.json [--cost cost.json] [--calibrate] [--save-cost out.json]

- `--recipe`: a recipe's own settings before it runs (`recipe_trace`: one rollout engine's share of a
  step), over response lengths from a file or an assumed log-normal (`lognormal_groups`):

    python -m bench.rollout_projection --recipe recipes/7b_boba_icepop_c3po.yaml --lognormal 10000,0.4,0.45
"""

from __future__ import annotations

import argparse
import json
import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from bench.c3po_compare import coefficient_of_variation, run_steps
from rlrecipe.c3po_budget import TokenBudget, admit
from rlrecipe.recipe import RLSection
from rlrecipe.rollout.base import Refill, RolloutEngine
from rlrecipe.rollout.inprocess import EngineCounters, band_cells, decode_bands
from rlrecipe.trajectory import SamplingParams, Status, Trajectory


@dataclass
class CostModel:
    """Seconds of rollout (and training) work, linear in what is done:

    decode step = step_s + row_s * rows in the batch + ctx_s * context tokens the rows attend to
    prefill call = prefill_call_s + prefill_token_s * tokens prefilled (identical sequences once)
                   + prefill_cell_s * rows x width of the cache it lays out (the in-process
                   engine's left-padded cache; 0 on a server's paged cache)
    refill = refill_cell_s * cache cells copied (the in-process engine's left-padded cache; 0 on a
             server's paged cache)
    training step = train_step_s + train_token_s * response tokens trained
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
    label: str = ""

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))


# The default, an ASSUMPTION: Qwen2.5-7B-like (N = 7.6e9 parameters, 28 layers, 4 KV heads of 128)
# in bf16 on one H100 SXM (HBM3 3.35 TB/s, about 2.6 TB/s reached; 989 dense bf16 TFLOP/s), served
# with continuous batching over a paged KV cache.
# - step_s: a decoding step reads the 15.2 GB of weights once: 15.2e9 B / 2.6e12 B/s = 5.8 ms, plus
#   about 1.2 ms of scheduling, sampling and launches: 7 ms whatever the batch.
# - row_s: each row adds 2N = 15.2 GFLOP (15.4 us at peak). The GEMMs of a large decoding batch
#   reach ~75% of peak and overlap the weight read, so ~20 us per row above the floor; linear in
#   the batch, this overstates mid-size batches, which understates C3PO++'s gain.
# - ctx_s: each context token's K and V: 2 x 28 x 4 x 128 x 2 B = 57 KB read per step:
#   57,344 B / 2.6e12 B/s = 22 ns.
# - prefill_token_s: the same 2N FLOP per token at ~70% of peak (large GEMMs; attention is small
#   at these lengths): 15.2e9 / 6.9e14 = 22 us; prefill_call_s: 2 ms per prefill batch (one
#   scheduler iteration). So re-prefilling a resumed rollout costs about what decoding its
#   tokens cost above the floor: C3PO++ pays it after every weight update.
# - prefill_cell_s, refill_cell_s: 0, a paged KV cache is written in place, never re-laid out.
# - train_token_s: 8N FLOP per trained token (6N forward and backward, 2N recomputing the old
#   log-probs) at 40% of peak: 6.1e10 / 4.0e14 = 150 us; train_step_s: 5 s per step for the
#   optimizer step and pushing 15 GB of weights to the rollout engine.
H100_7B_ASSUMED = CostModel(
    step_s=7.0e-3, row_s=2.0e-5, ctx_s=2.2e-8, prefill_call_s=2.0e-3, prefill_token_s=2.2e-5, prefill_cell_s=0.0,
    refill_cell_s=0.0,
    train_step_s=5.0, train_token_s=1.5e-4,
    label="ASSUMPTION: 7B model, bf16, one H100 SXM, continuous batching, paged KV (bench/rollout_projection.py)")

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


# -- where simulated rows get their lengths ---------------------------------------------------
def _draw(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n


class Lengths:
    """The response length (and how it ends) of each simulated trajectory.

    `shared`: uid -> {uid: first response tokens in common}, for members of one group whose
    responses began alike (a replay prefills identical partial responses once, as the engines do).
    `known`: uid -> (length, status) of a recorded run (replay). Trajectories not in it (a
    schedule that drew more prompts than the recorded one) take a recorded group's lengths,
    chosen by a hash of their group id, or, with `groups` (lists of response lengths, one list
    per prompt; a flat list is one length per trajectory), a group from those.
    """

    def __init__(self, max_new_tokens: int, known: dict[str, tuple[int, str]] | None = None,
                 groups: list[list[int]] | list[int] | None = None, shared: dict[str, dict[str, int]] | None = None):
        self.max_new_tokens = max_new_tokens
        self.known = known or {}
        self.shared = shared or {}
        if groups is None:
            by_group: dict[str, list[tuple[int, str]]] = {}
            for uid, v in self.known.items():
                by_group.setdefault(uid.rsplit("#", 1)[0], []).append(v)
            self.groups = [g for g in by_group.values()]
        else:
            self.groups = [[(int(x), "")] for x in groups] if groups and not isinstance(groups[0], list) else [
                [(int(x), "") for x in g] for g in groups]
        if not self.known and not self.groups:
            raise ValueError("no lengths to simulate with")

    def __call__(self, t: Trajectory) -> tuple[int, str]:
        if t.uid in self.known:
            return self.known[t.uid]
        member = t.uid.rsplit("#", 1)
        j = int(member[1]) if len(member) == 2 and member[1].isdigit() else _draw(t.uid, 1 << 16)
        group = self.groups[_draw(member[0], len(self.groups))]
        return group[j % len(group)]

    def same_so_far(self, a: Trajectory, b: Trajectory) -> bool:
        """Whether a and b (one prompt) hold the same response so far."""
        n = len(a.response_ids)
        if n != len(b.response_ids):
            return False
        common = self.shared.get(a.uid, {}).get(b.uid, self.shared.get(b.uid, {}).get(a.uid, 0))
        return common >= n

    def token(self, t: Trajectory) -> int:
        """A placeholder for t's next token: the same as the earliest group member's whose response
        began alike at least this far, else t's own (so a recorded replay re-records the same
        sharing, and responses that did not share differ)."""
        n = len(t.response_ids)
        owner = next((other for other, common in self.shared.get(t.uid, {}).items() if common > n), t.uid)
        return 3 + zlib.crc32(f"{owner}:{n}".encode()) % (1 << 30)

    def finish_at(self, t: Trajectory) -> int | None:
        """The response length at which `t` says eos, or None: it runs to max_new_tokens."""
        length, status = self(t)
        if status == Status.FINISHED.value or (not status and length < self.max_new_tokens):
            return length
        return None


class ReplayStream:
    """Hands out the groups a recorded run drew, in its order (same uids, same prompt lengths); past
    its end, the recorded groups again under new ids. Prompt tokens are placeholders."""

    def __init__(self, recorded: list[list]):
        self.groups: list[tuple[str, int]] = []  # group id, prompt length
        for _, gid, prompt_len, *_ in recorded:
            if not self.groups or self.groups[-1][0] != gid:
                self.groups.append((gid, prompt_len))
        self.cursor = 0

    def next_group(self, n: int) -> list[Trajectory]:
        lap, i = divmod(self.cursor, len(self.groups))
        gid, prompt_len = self.groups[i]
        gid = gid if lap == 0 else f"{gid}~{lap}"
        self.cursor += 1
        prompt = [1] * prompt_len
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=prompt, group_id=gid) for j in range(n)]


class SyntheticStream:
    """Groups of `prompt_len`-token placeholder prompts, for lengths given as a distribution."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.cursor = prompt_len, 0

    def next_group(self, n: int) -> list[Trajectory]:
        gid = f"p{self.cursor}"
        self.cursor += 1
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=[1] * self.prompt_len, group_id=gid) for j in range(n)]


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


def _steady(steps: list[dict]) -> list[dict]:
    return [s for s in steps if not s.get("warmup")]


def report(steps: dict[str, list[dict]], cost: CostModel) -> dict:
    """Seconds per step and per trained token, speed-ups (rollout, and end to end with the train
    model), where the rollout seconds go, and steadiness, from per-step records of both modes."""
    out = {}
    per = {}
    for mode in ("sync", "c3po"):
        st = _steady(steps[mode])
        secs, tokens = sum(s["seconds"] for s in st), sum(s["tokens"] for s in st)
        train = len(st) * cost.train_step_s + cost.train_token_s * tokens
        per[mode] = (secs / len(st), secs / tokens, (secs + train) / tokens)
        out[f"{mode}_s_per_step"] = secs / len(st)
        out[f"{mode}_ms_per_1k_trained_tokens"] = 1e6 * secs / tokens
        c = {k: sum(s["counters"].get(k, 0) for s in st) for k in ("prefill_s", "decode_s", "refill_s")}
        for k, v in c.items():
            out[f"{mode}_share_{k[:-2]}"] = v / secs if secs else 0.0
        rows, dsteps, prefilled = (sum(s["counters"].get(k, 0) for s in st)
                                   for k in ("decode_rows", "decode_steps", "prefill_rows"))
        # tokens generated (each prefilled row's first token, then one per row and decoding step) per
        # token trained: > 1 is work dropped with stale rollouts or still in flight at the end, < 1
        # tokens trained that were generated before the first step counted; and rows per decoding
        # step, how full the device is kept
        out[f"{mode}_generated_per_trained_token"] = (rows + prefilled) / tokens if tokens else 0.0
        out[f"{mode}_mean_decode_batch"] = rows / dsteps if dsteps else 0.0
        # rollouts dropped as too stale (C3PO++'s sigma), per rollout trained or dropped: work lost,
        # and the longest responses missing from training; and the mean length of those trained
        trained, dropped = sum(s["trained"] for s in st), sum(s.get("dropped", 0) for s in st)
        out[f"{mode}_dropped_share"] = dropped / (trained + dropped) if trained + dropped else 0.0
        out[f"{mode}_mean_trained_length"] = tokens / trained if trained else 0.0
        # rows a server preempted for KV-cache room (each prefilled again later), per step
        out[f"{mode}_retracted_per_step"] = sum(s["counters"].get("retracted_rows", 0) for s in st) / len(st)
        out[f"{mode}_cv_tokens_per_step"] = coefficient_of_variation([s["tokens"] for s in st])
        out[f"{mode}_cv_step_s"] = coefficient_of_variation([s["seconds"] for s in st])
    out["speedup_per_step"] = per["sync"][0] / per["c3po"][0]
    out["speedup_per_trained_token"] = per["sync"][1] / per["c3po"][1]
    if cost.train_step_s or cost.train_token_s:
        out["end_to_end_speedup_per_trained_token"] = per["sync"][2] / per["c3po"][2]
    return out


def project(trace: dict, cost: CostModel, **kw) -> dict:
    """`report` of `simulate`: the projection of a recorded run under `cost`."""
    return report(simulate(trace, cost, **kw), cost)


# -- a recipe's settings, projected before it runs ---------------------------------------------
def recipe_trace(recipe, *, steps: int = 5, max_batch: int | None = None, prompt_len: int = 256,
                 kv_tokens: int | None = None, kv_reserve: float = 0.0) -> dict:
    """A `simulate` input (settings, no recorded trajectories) for one rollout engine's share of a
    recipe's step: prompts per step, C3PO++ pool capacity and token budget divided by the number of
    engines (servers x dp, or rollout.urls), its staleness and max_new_tokens as they are; with
    `kv_tokens` (`rlrecipe.plan.kv_cache_tokens`), the engine's KV cache bounds what it runs at once."""
    from rlrecipe.plan import rollout_engines

    ro, rl = recipe.rollout, recipe.rl
    engines = rollout_engines(recipe)
    prompts = max(1, round(rl.prompts_per_step / engines))
    rows = prompts * rl.samples_per_prompt
    pool = max(rl.samples_per_prompt, round(rl.c3po.pool_capacity / engines))
    return {"settings": {"steps": steps, "prompts_per_step": prompts, "samples_per_prompt": rl.samples_per_prompt,
                         "pool_capacity": pool, "max_staleness": rl.c3po.max_staleness, "refill": rl.c3po.refill,
                         "surplus": rl.c3po.surplus,
                         "token_budget": max(1, round(rl.c3po.token_budget / engines)),
                         "max_new_tokens": ro.max_new_tokens, "max_batch": max_batch or max(rows, pool),
                         "refill_fraction": 0.25, "layout": "server", "engines": engines, "prompt_len": prompt_len,
                         "kv_tokens": kv_tokens, "kv_reserve": kv_reserve},
            "trajectories": {"sync": [], "c3po": []}}


def lognormal_groups(median: float, prompt_sigma: float, sample_sigma: float, samples: int, max_new_tokens: int,
                     n_groups: int = 4096, seed: int = 0) -> list[list[int]]:
    """Response lengths, one list per prompt: a prompt's median is `median` x exp(N(0, prompt_sigma))
    (some prompts are harder), each sample log-normal around it with `sample_sigma`; lengths past
    max_new_tokens are cut there (truncated rollouts). An assumption to state, not a measurement."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        mu = math.log(median) + rng.gauss(0.0, prompt_sigma)
        out.append([max(1, min(max_new_tokens, round(rng.lognormvariate(mu, sample_sigma)))) for _ in range(samples)])
    return out


def lognormal_label(median: float, prompt_sigma: float, sample_sigma: float, max_new_tokens: int) -> str:
    """How results name the lengths `lognormal_groups` drew: an assumption."""
    return (f"ASSUMPTION: log-normal, median {median:g}, prompt sigma {prompt_sigma:g}, sample sigma {sample_sigma:g}, "
            f"cut at {max_new_tokens}")


def gpu_cost_model(path: str | Path = "bench/cost_model.json") -> tuple[CostModel, str]:
    """The GPU cost model and its name: fitted by `make bench-sglang` when it has run, else the
    H100 assumption."""
    path = Path(path)
    cost = CostModel.from_json(path) if path.exists() else H100_7B_ASSUMED
    return cost, cost.label or str(path)


# -- calibration ------------------------------------------------------------------------------
def nnls(rows: list[list[float]], y: list[float], iters: int = 200) -> list[float]:
    """Non-negative least squares, min |A x - y| with x >= 0 (Lawson-Hanson active set), columns
    scaled to unit norm first so features of very different sizes are treated alike."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)
    scale = a.norm(dim=0)
    scale[scale == 0] = 1
    a = a / scale
    n = a.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        candidates = (~passive) & (w > 1e-12 * max(1.0, float(w.abs().max())))
        if not candidates.any():
            break
        passive[int(torch.where(candidates, w, torch.full_like(w, -torch.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[passive] = torch.linalg.lstsq(a[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float((x[neg] / (x[neg] - z[neg])).min())
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return (x / scale).tolist()


def fit(samples: list[tuple[dict, float]], params: tuple[str, ...], held: CostModel | None = None) -> dict[str, float]:
    """Least-squares (non-negative) values of `params` from (counters, seconds) samples; the other
    parameters keep their values in `held` (their share of the seconds is taken off first)."""
    rows = [[float(c.get(FEATURES[p], 0)) for p in params] for c, _ in samples]
    rest = [s - (sum(getattr(held, p) * c.get(f, 0) for p, f in FEATURES.items() if p not in params) if held else 0)
            for c, s in samples]
    return dict(zip(params, nnls(rows, rest), strict=True))


def condition_number(samples: list[tuple[dict, float]], params: tuple[str, ...]) -> float:
    """Of the column-normalised feature matrix: large (say > 100) when these samples cannot tell
    the parameters apart, e.g. steps that all look alike; fit fewer parameters then."""
    import torch

    a = torch.tensor([[float(c.get(FEATURES[p], 0)) for p in params] for c, _ in samples], dtype=torch.float64)
    a = a[:, a.norm(dim=0) > 0]
    if a.shape[1] == 0:
        return float("inf")
    sv = torch.linalg.svdvals(a / a.norm(dim=0))
    return float(sv[0] / sv[-1]) if sv[-1] > 0 else float("inf")


def calibrate(trace: dict, *, by: str = "total", layout: str | None = None, params: tuple[str, ...] | None = None,
              held: CostModel | None = None) -> tuple[CostModel, dict]:
    """Fit a cost model to a recorded run: the simulator replays both schedules (features per
    step), and the measured per-step seconds are fitted to them. by "total": each step's wall
    seconds (all a server run gives); by "components": the engine's own per-step split
    (decode + sampling, prefill, refill seconds), each fitted to its own features; by "events":
    each prefill, decoding step and refill the engine recorded, fitted to its own work, so the
    step totals (and the sync / C3PO++ ratio) stay out of the fit and test it.

    `params`: the parameters to fit (default: all that the layout has); the others keep their
    values in `held` (default 0). Few, similar steps (a short server run) cannot separate many
    parameters: the check's condition number says so, and fitting fewer is then the remedy.

    Returns the model and a check: how far the replayed schedule is from the recorded one where
    the run kept counters, how well the fit reproduces the measured steps, and the conditioning."""
    layout = layout or trace["settings"].get("layout") or "server"
    zero = CostModel(0, 0, 0, 0, 0)
    held = held or zero
    replay = simulate(trace, zero, layout=layout)
    measured = trace["steps"]
    params = tuple(p for p in (params or FEATURES) if layout == "inprocess" or p not in ("refill_cell_s", "prefill_cell_s"))
    pairs = [(sim["counters"], real) for mode in ("sync", "c3po")
             for sim, real in zip(replay[mode], measured[mode], strict=True)]
    # where the run kept its engine's counters, how far the replayed schedule is from it
    kept = [(sim, real["counters"]) for sim, real in pairs if real.get("counters")]
    check = {f"replay_gap_{k}": max(abs(sim.get(k, 0) - real.get(k, 0)) / max(1, real.get(k, 0))
                                    for sim, real in kept)
             for k in ("forward_passes", "decode_rows", "decode_cells", "prefill_tokens", "prefill_cells",
                       "refill_cells")} if kept else {}
    values: dict[str, float] = {}
    if by == "events":
        events = [e for mode in ("sync", "c3po") for st in measured[mode] for e in st.get("events", ())]
        if not events:
            raise ValueError("by='events' needs a run whose engine kept its events (the in-process engine does)")
        for phase, group in PHASES.items():
            group = tuple(p for p in group if p in params)
            samples = [(work, secs) for ph, secs, work in events if ph == phase]
            if group and samples:
                values.update(fit(samples, group, held))
                check[f"condition_number_{phase}"] = condition_number(samples, group)
    elif by == "components":
        for secs, group in COMPONENTS.items():
            group = tuple(p for p in group if p in params)
            if group:
                samples = [(sim, sum(real["counters"][k] for k in secs)) for sim, real in pairs]
                values.update(fit(samples, group, held))
                check[f"condition_number_{secs[0][:-2]}"] = condition_number(samples, group)
    else:
        samples = [(sim, real["seconds"]) for sim, real in pairs]
        values = fit(samples, params, held)
        check["condition_number"] = condition_number(samples, params)
    cost = replace(held, **values, label=f"calibrated ({by}; {', '.join(values)}) from a measured run, layout {layout}")
    predicted = [rollout_seconds(cost, sim) for sim, _ in pairs]
    actual = [real["seconds"] for _, real in pairs]
    mean = sum(actual) / len(actual)
    ss_res = sum((p - a) ** 2 for p, a in zip(predicted, actual, strict=True))
    ss_tot = sum((a - mean) ** 2 for a in actual) or 1.0
    check.update(r2_step_seconds=1 - ss_res / ss_tot,
                 max_rel_error_step_seconds=max(abs(p - a) / a for p, a in zip(predicted, actual, strict=True)))
    return cost, check


def fit_train_model(rows: list[dict]) -> tuple[float, float]:
    """(train_step_s, train_token_s) from RL metrics rows (train_s, tokens_trained)."""
    x = nnls([[1.0, float(r["tokens_trained"])] for r in rows], [r["train_s"] for r in rows])
    return x[0], x[1]


def measured_ratio(trace: dict) -> float:
    """Measured s/trained-token, sync over C3PO++, from the recorded steps."""
    def per_token(steps):
        st = _steady(steps)
        return sum(s["seconds"] for s in st) / sum(s["tokens"] for s in st)
    return per_token(trace["steps"]["sync"]) / per_token(trace["steps"]["c3po"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", help="a bench.c3po_compare result with its trace (bench/c3po_server.json, or "
                                           "bench/results.json's c3po_vs_sync)")
    ap.add_argument("--recipe", help="instead of a run: this recipe's settings, one rollout engine's share of a "
                                     "step (needs --lengths or --lognormal)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    ap.add_argument("--lognormal", metavar="MEDIAN,PROMPT_SIGMA,SAMPLE_SIGMA",
                    help="draw response lengths from this assumed distribution (see lognormal_groups)")
    ap.add_argument("--steps", type=int, default=5, help="steps projected after the first (--recipe)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (--recipe)")
    ap.add_argument("--cost", help="cost model JSON (CostModel fields); default: the H100 / 7B assumption")
    ap.add_argument("--calibrate", action="store_true", help="fit the cost model to this run's step times first")
    ap.add_argument("--by", default="total", choices=("total", "components", "events"))
    ap.add_argument("--params", help="comma-separated parameters to fit (default: all); the others keep the "
                                     "values of --cost (or of the default assumption)")
    ap.add_argument("--save-cost", help="write the (calibrated) cost model here")
    ap.add_argument("--layout", choices=("server", "inprocess"), help="default: the recorded engine's")
    ap.add_argument("--max-batch", type=int, help="slots of the projected engine; default: the recorded engine's "
                                                  "(--recipe: every rollout of its share at once)")
    ap.add_argument("--lengths", help="JSON list of response lengths (or of lists, one per prompt) to draw from "
                                      "instead of replaying the run's")
    ap.add_argument("--kv-tokens", type=int, help="a server's KV cache in tokens (0: unbounded); default: "
                                                  "--recipe's from rlrecipe plan, a recorded run's none")
    ap.add_argument("--kv-reserve", type=float, default=0.0,
                    help="share of each admitted row's tokens to come (at most 4,096) kept free in the KV cache "
                         "(SGLang's new_token_ratio, about 0.1 to 0.7); default 0")
    args = ap.parse_args(argv)
    if (args.run is None) == (args.recipe is None):
        ap.error("give a recorded run or --recipe, one of them")
    cost = CostModel.from_json(args.cost) if args.cost else H100_7B_ASSUMED
    out: dict = {}
    if args.recipe:
        if args.calibrate or not (args.lengths or args.lognormal):
            ap.error("--recipe projects lengths given by --lengths or --lognormal, and has no run to calibrate on")
        from rlrecipe.plan import kv_cache_tokens
        from rlrecipe.recipe import load_recipe

        loaded = load_recipe(args.recipe, args.set)
        kv = kv_cache_tokens(loaded) if args.kv_tokens is None else args.kv_tokens or None
        trace = recipe_trace(loaded.recipe, steps=args.steps, max_batch=args.max_batch, prompt_len=args.prompt_len,
                             kv_tokens=kv, kv_reserve=args.kv_reserve)
        out["settings"] = trace["settings"]
    else:
        data = json.loads(Path(args.run).read_text())
        trace = data.get("trace") or data.get("c3po_vs_sync", {}).get("trace")
        if trace is None:
            raise SystemExit(f"{args.run}: no trace (per-step timings and lengths); rerun bench.c3po_compare")
    if args.calibrate:
        params = tuple(args.params.split(",")) if args.params else None
        fitted, check = calibrate(trace, by=args.by, layout=args.layout, params=params,
                                  held=cost if params else None)
        source = data.get("model") or data.get("c3po_vs_sync", {}).get("model") or ""
        cost = replace(fitted, train_step_s=cost.train_step_s, train_token_s=cost.train_token_s,
                       label=f"{fitted.label}: {args.run} {source}; train model from "
                             f"{args.cost or 'the default assumption'}")
        out["calibration"] = {**asdict(fitted), **check}
    if args.run and args.kv_tokens:
        trace["settings"].update(kv_tokens=args.kv_tokens, kv_reserve=args.kv_reserve)
    groups = json.loads(Path(args.lengths).read_text()) if args.lengths else None
    if args.lognormal:
        median, prompt_sigma, sample_sigma = (float(x) for x in args.lognormal.split(","))
        settings = trace["settings"]
        groups = lognormal_groups(median, prompt_sigma, sample_sigma, settings["samples_per_prompt"],
                                  settings["max_new_tokens"])
        out["lengths"] = lognormal_label(median, prompt_sigma, sample_sigma, settings["max_new_tokens"])
    out["cost_model"] = cost.label
    out["projected"] = project(trace, cost, layout=args.layout, max_batch=args.max_batch, groups=groups)
    if args.run:
        out["measured_speedup_per_trained_token"] = measured_ratio(trace)
    if args.save_cost:
        cost.to_json(args.save_cost)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
