"""Packing variable-length sequences into 1-D micro-batches under a token budget.

No padding is computed in training: sequences are concatenated, position ids restart at each
sequence start, and the model's attention is confined to each sequence (transformers derives
a block-diagonal causal mask from restarting position ids).
"""

from __future__ import annotations

import heapq
import math

import torch


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:  # a sequence longer than the budget gets a micro-batch of its own
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_bins(lengths: list[int], num_bins: int, budget: int) -> list[list[int]] | None:
    """Longest-first into the least-loaded bin; None if some sequence does not fit."""
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, b = heapq.heappop(heap)
        if load + lengths[i] > budget and load > 0:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def allocate_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Fewest micro-batches first-fit-decreasing finds, then balance tokens across that many.

    Returns lists of indices into `lengths`, each list in ascending order (stable data order).
    """
    if not lengths:
        return []
    ffd = first_fit_decreasing(lengths, budget)
    lower = max(1, math.ceil(sum(lengths) / budget))
    for k in range(lower, len(ffd) + 1):
        bins = balanced_bins(lengths, k, budget)
        if bins is not None:
            return [sorted(b) for b in bins if b]
    return [sorted(b) for b in ffd]


def pack(seqs: list[list[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate sequences (lists or 1-D integer tensors) into input_ids [1, T] and position_ids
    [1, T] restarting per sequence."""
    ids = torch.cat([torch.as_tensor(s, dtype=torch.long) for s in seqs])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos


def response_rows(samples) -> torch.Tensor:
    """Positions, in the `pack`ed row of these samples (TrainSample: input_ids, start), of the hidden
    states that predict each response token: a token at position t is predicted at t - 1."""
    rows, offset = [], 0
    for s in samples:
        rows.append(torch.arange(offset + s.start - 1, offset + len(s.input_ids) - 1))
        offset += len(s.input_ids)
    return torch.cat(rows)

