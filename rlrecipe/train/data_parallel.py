"""The global batch split over data-parallel ranks, and what the ranks agree on after their shares.

Every rank is handed the same global batch and takes its share of the samples, tokens balanced
over ranks. ZeRO runs collectives in every forward and backward, so a rank with fewer micro-batches
than the busiest one runs padding micro-batches (`padding_microbatch`, its loss multiplied by 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlrecipe.algo.packing import balanced_bins
from rlrecipe.train.base import TrainSample

PAD_TOKEN = 0


def shard(lengths: list[int], rank: int, world: int) -> list[int]:
    """Indices of the samples (of these token lengths) that `rank` handles, data order kept."""
    if world == 1:
        return list(range(len(lengths)))
    bins = balanced_bins(lengths, world, budget=sum(lengths) + 1) or [[] for _ in range(world)]
    return sorted(bins[rank])


def max_over_ranks(n: int, world: int, device: torch.device) -> int:
    if world == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)  # nccl reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    if world == 1:
        return dict(values)
    gathered: list[dict[str, float]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, values)
    out: dict[str, float] = {}
    for part in gathered:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def padding_microbatch() -> list[TrainSample]:
    """A 2-token dummy sequence: the collectives of a real micro-batch; its result is not used (in a
    training step its loss is multiplied by 0: zero gradient)."""
    return [TrainSample([PAD_TOKEN, PAD_TOKEN], 1)]
