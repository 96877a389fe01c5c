"""In-process rollout engine on transformers/torch: the CPU path and the reference for SGLang.

Batched decoding with a KV cache over a fixed number of slots. When a share of the slots has
finished, queued trajectories are prefilled on their own and their cache rows joined to those
in flight (left-padded to a common width); finished rows leave the cache. A trajectory that
comes back with a partial response (a C3PO++ resume under new weights) is prefilled from
prompt + partial response, since its old cache belongs to old weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from rlrecipe.modeling import load_model, load_weights_into
from rlrecipe.rollout.base import SEED_KEY, RolloutEngine
from rlrecipe.trajectory import SamplingParams, Status, Trajectory


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

    def join(self, other: _Batch) -> _Batch:
        """Append other's rows; the narrower side is left-padded with masked zeros."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        return _Batch(torch.cat([self.logits, other.logits]), self.cache, mask,
                      torch.cat([self.last_pos, other.last_pos]))


class InProcessEngine(RolloutEngine):
    def __init__(self, model_dir: str | Path, eos_token_id: int, pad_token_id: int, dtype: str = "float32",
                 max_batch: int = 512, refill_fraction: float = 0.25, version: int = 0):
        self.dtype = dtype
        self.model = load_model(model_dir, dtype).eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.max_batch = max_batch
        self.refill_fraction = refill_fraction
        self.version = version
        # batched forward passes so far: on a GPU, where decoding is memory-bound, their number
        # (not the batch size) is what a rollout costs; benchmarks report it beside seconds
        self.forward_passes = 0
        self._scratch = torch.Generator()  # reseeded per token for trajectories with their own seed

    # -- weights ----------------------------------------------------------------------------
    def update_weights_from_disk(self, model_dir: str | Path, version: int) -> None:
        load_weights_into(self.model, model_dir)  # in place: same architecture, as SGLang requires
        self.version = version

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state_dict.items():
                if name in own:
                    own[name].copy_(tensor.to(own[name].dtype))
        self.version = version

    # -- decoding ---------------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, rows: list[Trajectory]) -> _Batch:
        seqs = [t.prompt_ids + t.response_ids for t in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        self.forward_passes += 1
        # only the last position's logits are needed: [rows, V], not [rows, width, V]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=DynamicCache(),
                         use_cache=True, logits_to_keep=1)
        return _Batch(out.logits[:, -1, :].float(), out.past_key_values, mask, pos[:, -1])

    @torch.no_grad()
    def _step(self, tokens: torch.Tensor, b: _Batch) -> _Batch:
        mask = torch.cat([b.mask, torch.ones((b.mask.shape[0], 1), dtype=b.mask.dtype)], dim=1)
        pos = b.last_pos + 1
        self.forward_passes += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=pos[:, None],
                         past_key_values=b.cache, use_cache=True, logits_to_keep=1)
        return _Batch(out.logits[:, -1, :].float(), out.past_key_values, mask, pos)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                rows: list[Trajectory] | None = None):
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

    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None) -> list[Trajectory]:
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        queue = [t for t in trajs if not t.done and t.status != Status.ABORTED]
        queue.reverse()  # pop() from the end keeps the caller's order
        for t in queue:
            t.status = Status.RUNNING
            if len(t.response_ids) >= params.max_new_tokens:
                t.status = Status.TRUNCATED
        queue = [t for t in queue if t.status == Status.RUNNING]
        finished_tokens = 0
        rows: list[Trajectory] = []
        batch: _Batch | None = None
        while queue or rows:
            live = [i for i, r in enumerate(rows) if r.status == Status.RUNNING]
            free = self.max_batch - len(live)
            if queue and (not live or free >= max(1, int(self.refill_fraction * self.max_batch))):
                # only the newcomers are prefilled; the rows in flight keep their cache
                new = [queue.pop() for _ in range(min(free, len(queue)))]
                fresh = self._prefill(new)
                batch = batch.select(live).join(fresh) if live else fresh
                rows = [rows[i] for i in live] + new
            elif len(live) < len(rows):
                if not live:
                    rows = []
                    continue
                if len(live) <= len(rows) // 2:  # compact only when it halves the work
                    batch = batch.select(live)
                    rows = [rows[i] for i in live]
            tok, lp = self._sample(batch.logits, params, gen, rows)
            tokens, logps = tok.tolist(), lp.tolist()  # one conversion per step, not one per row
            for i, t in enumerate(rows):
                if t.status != Status.RUNNING:
                    continue
                t.append(tokens[i], logps[i], self.version)
                if tokens[i] == self.eos:
                    t.status = Status.FINISHED
                elif len(t.response_ids) >= params.max_new_tokens:
                    t.status = Status.TRUNCATED
                if t.done:
                    finished_tokens += len(t.response_ids)
            if token_budget is not None and finished_tokens >= token_budget:
                break
            if any(r.status == Status.RUNNING for r in rows):
                batch = self._step(tok, batch)
            else:
                rows = []
        return trajs
