"""In-process rollout engine on transformers/torch: the CPU path and the reference for SGLang.

Batched decoding with a KV cache over a fixed number of slots. When a share of the slots has
finished, queued trajectories are prefilled on their own and their cache rows joined to those
in flight (left-padded to a common width); finished rows leave the cache. A trajectory that
comes back with a partial response (a C3PO++ resume under new weights) is prefilled from
prompt + partial response, since its old cache belongs to old weights. The cache is a
`GrowingCache` (rollout/kv_cache.py): a decoding step writes its keys and values into spare room
rather than copying the whole cache, as transformers' DynamicCache does.

Prefill is packed: the sequences to prefill are laid end to end in one row, positions
restarting at each, and attended per document, so its cost follows their real tokens and not
rows x the longest row (C3PO++ re-prefills every resumed rollout after each weight update,
and those are as long as the rollouts are). Identical sequences (the fresh samples of one
prompt) are prefilled once. Each sequence's keys and values are then laid into the
left-padded cache layout that decoding uses.

Decoding attends by bands of rows of similar lengths; rows are kept longest first for it. Both
attentions are `packed_attention.py`'s.

`kv_cache_dtype` fp8_e4m3 / fp8_e5m2 stores the cache in FP8 with per-layer scales (rollout/fp8_kv.py):
unit scales, or scales calibrated from the current weights at the first generation after each push.
Evaluation through the engine uses the same cache.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from rlrecipe.modeling import load_model, load_weights_into
from rlrecipe.rollout.base import MEMORY_TAGS, SEED_KEY, Refill, RolloutEngine
from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.rollout.engine_memory import EngineMemory
from rlrecipe.rollout.fp8_kv import KVQuant
from rlrecipe.rollout.kv_cache import GrowingCache
from rlrecipe.rollout.packed_attention import band_cells, decode_bands, register_attention
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf (for sampling only)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if t.shape[dim] == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - t.shape[dim]
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class EngineCounters:
    """Cumulative work and seconds of one engine (a benchmark takes differences around a step).

    prefill: forward passes over newcomers' prompt + response so far (at the start of a call
    and at every refill); decode: one-token forward passes over the rows in flight; refill:
    laying newcomers' cache rows beside those in flight, and compacting; sample: choosing
    tokens and the per-row bookkeeping of each step.
    """

    forward_passes: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    refill_s: float = 0.0
    sample_s: float = 0.0
    generate_s: float = 0.0
    prefill_calls: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0        # tokens run through the model (identical sequences once)
    reprefill_tokens: int = 0      # of those, response tokens already sampled (resumed rollouts)
    prefill_cells: int = 0         # rows x width of the caches prefills laid out
    decode_steps: int = 0
    decode_rows: int = 0           # sum over decoding steps of the rows in the batch
    decode_cells: int = 0          # sum over decoding steps and bands of rows x band width (what attention reads)
    refill_cells: int = 0          # rows x cache width of each cache rebuilt by a refill or compaction
    retracted_rows: int = 0        # rows a server preempted when its KV cache ran out (simulated servers only)

    def as_dict(self) -> dict:
        return asdict(self)


_NOISE_SALT = 0x5DEECE66D  # separates the stress test's noise stream from the sampling stream
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, position) pairs over seed space


def _row_generator(t: Trajectory, shared: torch.Generator, scratch: torch.Generator) -> torch.Generator:
    """The generator for t's next token: `scratch` reseeded from (its seed, its position) when it
    has a seed, else the batch's shared stream."""
    if SEED_KEY not in t.meta:
        return shared
    return scratch.manual_seed((int(t.meta[SEED_KEY]) ^ (len(t.response_ids) * _MIX)) & (2**63 - 1))


@dataclass
class _Batch:
    """The decoding state of the rows in flight: next-token logits, KV cache, mask, positions."""

    logits: torch.Tensor
    cache: DynamicCache
    mask: torch.Tensor
    last_pos: torch.Tensor

    def select(self, keep: list[int]) -> _Batch:
        """Keep these rows, then drop the left columns that only padding still uses."""
        idx = torch.tensor(keep)
        self.cache.batch_select_indices(idx)
        mask = self.mask[idx]
        first = int(mask.any(0).nonzero()[0])
        if first:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            mask = mask[:, first:]
        return _Batch(self.logits[idx], self.cache, mask, self.last_pos[idx])

    def join(self, other: _Batch) -> tuple[_Batch, list[int]]:
        """Append other's rows, the narrower side left-padded with masked zeros, and order all rows
        longest first (both sides are already; decoding attends per band of lengths). Returns the
        batch and, for each of its rows, its index among self's rows followed by other's."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        order = torch.sort(mask.sum(1), descending=True, stable=True).indices
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])[order]
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])[order]
        return _Batch(torch.cat([self.logits, other.logits])[order], self.cache, mask[order],
                      torch.cat([self.last_pos, other.last_pos])[order]), order.tolist()


def cache_keyword(model) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers, which warn that
    `past_key_values` is deprecated; `past_key_values` in those before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class InProcessEngine(RolloutEngine):
    def __init__(self, model_dir: str | Path, eos_token_id: int, pad_token_id: int, dtype: str = "float32",
                 max_batch: int = 512, refill_fraction: float = 0.25, version: int = 0,
                 kv_cache_dtype: str = "auto", kv_scales: str = "unit"):
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_quant = KVQuant.of(kv_cache_dtype, kv_scales)  # None: the cache in the engine's dtype
        self.model = load_model(model_dir, dtype, register_attention()).eval()
        self._cache_kw = cache_keyword(self.model)
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_batch = max_batch
        self.refill_fraction = refill_fraction
        self.version = version
        # work and seconds so far, by phase; benchmarks read them around each step
        self.counters = EngineCounters()
        # packed prefill (the default); False: left-padded prefill, kept as the reference it replaces
        self.packed_prefill = True
        # set to a list to also keep every prefill, decoding step and refill as [phase, seconds,
        # {work counter: amount}] (what a cost model is calibrated on, one event at a time)
        self.events: list | None = None
        self._scratch = torch.Generator()  # reseeded per token for trajectories with their own seed
        self._step_cells = 0  # cache cells the last decoding step attended (for its event)
        self.memory = EngineMemory(self.model)  # rollout.colocate: released while the trainer trains

    @property
    def forward_passes(self) -> int:
        """Batched forward passes so far: on a GPU, where decoding is memory-bound, their number
        (not the batch size) is what a rollout costs; benchmarks report it beside seconds."""
        return self.counters.forward_passes

    # -- weights ----------------------------------------------------------------------------
    def update_weights_from_disk(self, model_dir: str | Path, version: int, verify: bool = True) -> None:
        self.memory.pushed()
        load_weights_into(self.model, model_dir)  # in place: same architecture, as SGLang requires
        self.version = version
        self._scales_stale()

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        self.memory.pushed()
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state_dict.items():
                if name in own:
                    own[name].copy_(tensor.to(own[name].dtype))
        self.version = version
        self._scales_stale()

    def _scales_stale(self) -> None:
        # recalibrated at the next generation, not here: a push may come in several buckets
        if self.kv_quant is not None:
            self.kv_quant.stale = True

    def _new_cache(self) -> GrowingCache:
        """An empty KV cache for a forward pass: FP8 with current scales where kv_cache_dtype asks."""
        q = self.kv_quant
        if q is not None and q.calibrated and q.stale:
            q.calibrate(self.model, self._cache_kw)
        return GrowingCache(q)

    # -- colocated layouts ------------------------------------------------------------------
    def release_memory(self, tags=MEMORY_TAGS) -> None:
        self.memory.release(tags)

    def resume_memory(self, tags) -> None:
        self.memory.resume(tags)

    def verify_push(self, version: int, *, state_dict: dict | None = None, model_dir: str | Path | None = None) -> None:
        """Exact: every pushed tensor, cast to the engine's dtype, equals what the engine holds."""
        if state_dict is None:
            return  # a disk push loads the export itself, with transformers' own checks
        own = self.model.state_dict()
        differ = [name for name, t in state_dict.items()
                  if name in own and not torch.equal(own[name], t.to(own[name].dtype).to(own[name].device))]
        if differ or self.version != version:
            raise RuntimeError(f"the in-process engine does not hold the pushed weights of version {version} "
                               f"(it holds version {self.version}; {len(differ)} tensors differ: {differ[:3]})")

    # -- decoding ---------------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, rows: list[Trajectory]) -> _Batch:
        t0 = time.perf_counter()
        c = self.counters
        tokens = c.prefill_tokens
        batch = self._prefill_packed(rows) if self.packed_prefill else self._prefill_padded(rows)
        c.forward_passes += 1
        c.prefill_calls += 1
        c.prefill_rows += len(rows)
        c.reprefill_tokens += sum(len(t.response_ids) for t in rows)
        c.prefill_cells += batch.mask.numel()
        dt = time.perf_counter() - t0
        c.prefill_s += dt
        if self.events is not None:
            self.events.append(["prefill", dt, {"prefill_calls": 1, "prefill_tokens": c.prefill_tokens - tokens,
                                                "prefill_cells": batch.mask.numel()}])
        return batch

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The log-prob of each token of `ids` after the first, given the ones before it (a
        teacher-forced pass at temperature 1, as SGLang's input_token_logprobs)."""
        self.memory.check_can_generate()
        x = torch.tensor([ids])
        out = self.model(input_ids=x, attention_mask=torch.ones_like(x), position_ids=torch.arange(len(ids))[None],
                         **{self._cache_kw: self._new_cache()}, use_cache=True)
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()

    def _prefill_padded(self, rows: list[Trajectory]) -> _Batch:
        seqs = [t.prompt_ids + t.response_ids for t in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        self.counters.prefill_tokens += ids.numel()
        # only the last position's logits are needed: [rows, V], not [rows, width, V]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **{self._cache_kw: self._new_cache()},
                         use_cache=True, logits_to_keep=1)
        return _Batch(out.logits[:, -1, :].float(), returned_cache(out), mask, pos[:, -1])

    def _prefill_packed(self, rows: list[Trajectory]) -> _Batch:
        """One row holding each distinct sequence once (sorted by length), attended per sequence; then
        each trajectory's keys/values are gathered into its left-padded row of the cache."""
        distinct = sorted({tuple(t.prompt_ids + t.response_ids) for t in rows}, key=len)  # equal lengths adjacent
        seqs = {s: i for i, s in enumerate(distinct)}
        which = [seqs[tuple(t.prompt_ids + t.response_ids)] for t in rows]
        lens = torch.tensor([len(s) for s in distinct])
        ends = lens.cumsum(0)
        starts = ends - lens
        total = int(ends[-1])
        ids = torch.tensor([tok for s in distinct for tok in s])[None]
        pos = (torch.arange(total) - starts.repeat_interleave(lens))[None]
        self.counters.prefill_tokens += total
        layer_types = set(getattr(self.model.config, "layer_types", None) or ["full_attention"])
        out = self.model(input_ids=ids, position_ids=pos, **{self._cache_kw: self._new_cache()}, use_cache=True,
                         attention_mask={lt: None for lt in layer_types},  # no mask: documents come from cu_seq_lens
                         cu_seq_lens_q=torch.cat([starts[:1], ends]).to(torch.int32), max_length_q=int(lens.max()),
                         logits_to_keep=ends - 1)
        # row i, column j of the left-padded layout reads packed position src[i, j]; the padding reads
        # position 0, whatever it holds: the mask keeps decoding steps from attending to it
        which = torch.tensor(which)
        row_lens = lens[which]
        width = int(row_lens.max())
        col = torch.arange(width)[None]
        lead = width - row_lens[:, None]
        src = torch.where(col >= lead, starts[which][:, None] + col - lead, 0)
        flat = src.reshape(-1)
        cache = returned_cache(out)
        for layer in cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)[0]  # [H, total, D]
                setattr(layer, name, x.index_select(1, flat).unflatten(1, src.shape).transpose(0, 1))
        mask = (col >= lead).long()
        return _Batch(out.logits[0, which].float(), cache, mask, row_lens - 1)

    @torch.no_grad()
    def _step(self, tokens: torch.Tensor, b: _Batch) -> _Batch:
        t0 = time.perf_counter()
        mask = torch.cat([b.mask, torch.ones((b.mask.shape[0], 1), dtype=b.mask.dtype)], dim=1)
        pos = b.last_pos + 1
        lengths = mask.sum(1)
        # rows are kept longest first (prefill and join order them; every row grows by one a step)
        bands = decode_bands(lengths.tolist()) if bool((lengths[1:] <= lengths[:-1]).all()) else \
            [(0, mask.shape[0], mask.shape[1])]
        out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=pos[:, None],
                         **{self._cache_kw: b.cache}, use_cache=True, logits_to_keep=1, decode_bands=bands)
        c = self.counters
        c.forward_passes += 1
        c.decode_steps += 1
        c.decode_rows += mask.shape[0]
        self._step_cells = band_cells(bands)
        c.decode_cells += self._step_cells
        c.decode_s += time.perf_counter() - t0
        return _Batch(out.logits[:, -1, :].float(), returned_cache(out), mask, pos)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                rows: list[Trajectory] | None = None, noise: torch.Generator | None = None):
        if params.logit_noise > 0:  # the stress test: sample from, and record, a perturbed distribution
            logits = logits + params.logit_noise * torch.randn(logits.shape, generator=noise)
        if params.greedy or params.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(-1)
        else:
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), -1)
            if rows is not None and any(SEED_KEY in t.meta for t in rows):
                tok = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=_row_generator(t, gen, self._scratch))
                                 for i, t in enumerate(rows)]).squeeze(-1)
            else:
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def _refilled(self, seconds: float, batch: _Batch) -> None:
        self.counters.refill_s += seconds
        self.counters.refill_cells += batch.mask.numel()
        if self.events is not None:
            self.events.append(["refill", seconds, {"refill_cells": batch.mask.numel()}])

    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None,
                 refill: Refill | None = None) -> list[Trajectory]:
        self.memory.check_can_generate()
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        # its own stream, so turning the stress test on leaves the sampling stream as it was
        noise = torch.Generator().manual_seed((0 if seed is None else seed) ^ _NOISE_SALT)
        queue = admit(trajs, params)[::-1]  # pop() from the end keeps the caller's order
        budget = TokenBudget(token_budget)
        rows: list[Trajectory] = []
        batch: _Batch | None = None
        start = time.perf_counter()
        while queue or rows:
            rows, batch = self._rows_in_flight(queue, rows, batch)
            if not rows:
                continue  # nothing running and nothing queued
            tok, ended, sampled = self._sample_rows(batch, rows, params, gen, noise, budget)
            if budget.reached:
                break
            if refill is not None and ended:
                queue[:0] = refill(ended)[::-1]  # fresh, behind those queued already (pop() takes the last)
            if any(r.status == Status.RUNNING for r in rows):
                batch = self._decode(tok, batch, sampled)
            else:
                rows = []
        self.counters.generate_s += time.perf_counter() - start
        return trajs

    def _rows_in_flight(self, queue: list[Trajectory], rows: list[Trajectory],
                        batch: _Batch | None) -> tuple[list[Trajectory], _Batch | None]:
        """The rows to sample from next: once enough slots are free, newcomers popped from `queue`
        are prefilled and joined to the running rows (which keep their cache); else finished rows
        are compacted away where that halves the work. No rows: nothing runs and nothing is queued."""
        clock = time.perf_counter
        live = [i for i, r in enumerate(rows) if r.status == Status.RUNNING]
        free = self.max_batch - len(live)
        if queue and (not live or free >= max(1, int(self.refill_fraction * self.max_batch))):
            # only the newcomers are prefilled; the rows in flight keep their cache
            new = [queue.pop() for _ in range(min(free, len(queue)))]
            new.sort(key=lambda t: -t.num_tokens)  # longest first, as decoding needs (stable)
            fresh = self._prefill(new)
            if not live:
                return new, fresh
            t0 = clock()
            batch, order = batch.select(live).join(fresh)
            self._refilled(clock() - t0, batch)
            joined = [rows[i] for i in live] + new
            return [joined[i] for i in order], batch
        if len(live) < len(rows):
            if not live:
                return [], batch
            if len(live) <= len(rows) // 2:  # compact only when it halves the work
                t0 = clock()
                batch = batch.select(live)
                self._refilled(clock() - t0, batch)
                rows = [rows[i] for i in live]
        return rows, batch

    def _sample_rows(self, batch: _Batch, rows: list[Trajectory], params: SamplingParams, gen: torch.Generator,
                     noise: torch.Generator, budget: TokenBudget) -> tuple[torch.Tensor, int, float]:
        """Each running row's next token appended with its log-prob and this engine's version, and
        its end marked; the tokens, how many rows ended (counted against `budget`), and the seconds."""
        t0 = time.perf_counter()
        tok, lp = self._sample(batch.logits, params, gen, rows, noise)
        tokens, logps = tok.tolist(), lp.tolist()  # one conversion per step, not one per row
        ended = 0
        for i, t in enumerate(rows):
            if t.status != Status.RUNNING:
                continue
            t.append(tokens[i], logps[i], self.version)
            if tokens[i] == self.eos:
                t.status = Status.FINISHED
            elif len(t.response_ids) >= params.max_new_tokens:
                t.status = Status.TRUNCATED
            ended += budget.count(t)
        sampled = time.perf_counter() - t0
        self.counters.sample_s += sampled
        return tok, ended, sampled

    def _decode(self, tok: torch.Tensor, batch: _Batch, sampled: float) -> _Batch:
        t0 = time.perf_counter()
        batch = self._step(tok, batch)
        if self.events is not None:  # one decoding step: its sampling and its forward pass
            self.events.append(["decode", sampled + time.perf_counter() - t0, {
                "decode_steps": 1, "decode_rows": batch.mask.shape[0], "decode_cells": self._step_cells}])
        return batch
