"""Critic-free advantages: gamma = lambda = 1, so every response token gets its sequence's reward."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

EPS = 1e-5
GROUP_MODES = ("group", "group_mean", "group_quantile")


def empirical_quantile(values: torch.Tensor, k: float) -> torch.Tensor:
    """The K-quantile of the values' empirical distribution: the smallest value v with
    #(values <= v) >= k n. On binary rewards this is the low reward exactly when the success rate
    p <= 1 - k, QAE's two regimes (arXiv:2509.22611)."""
    ordered = torch.sort(values).values
    # k n can land a rounding error above an integer (0.4 x 5 = 2.0000000000000004)
    rank = max(1, math.ceil(k * len(ordered) - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


def sequence_advantages(rewards: list[float], lengths: list[int], group_ids: list[str], mode: str,
                        quantile: float = 0.4) -> list[float]:
    """One advantage per sequence (shared by all its tokens).

    global:         (R - mean) / (std + 1e-5) with mean and std over all valid tokens of the batch
                    (each sequence weighs by its length) - AReaL-boba's default.
    group:          GRPO-style, (R - mean) / (std + 1e-5) over the sequences of each prompt group.
    group_mean:     Dr. GRPO (arXiv:2503.20783): R - group mean, no division by the std.
    group_quantile: QAE (arXiv:2509.22611): (R - group K-quantile) / (std + 1e-5), K = `quantile`.
    none:           the raw reward.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    if mode == "none":
        return r.tolist()
    if mode == "global":
        w = torch.tensor(lengths, dtype=torch.float64)
        mean = (r * w).sum() / w.sum()
        std = torch.sqrt(((r - mean) ** 2 * w).sum() / w.sum())
        return ((r - mean) / (std + EPS)).tolist()
    if mode in GROUP_MODES:
        members: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(group_ids):
            members[g].append(i)
        out = torch.zeros_like(r)
        for idx in members.values():
            rg = r[idx]
            if mode == "group_mean":
                out[idx] = rg - rg.mean()
                continue
            std = rg.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0, dtype=torch.float64)
            baseline = empirical_quantile(rg, quantile) if mode == "group_quantile" else rg.mean()
            out[idx] = (rg - baseline) / (std + EPS)
        return out.tolist()
    raise ValueError(f"unknown advantage normalisation {mode!r}")


def scale_negative_advantages(adv: list[float], factor: float) -> list[float]:
    """Negative advantages times `factor`, after normalisation; positive ones unchanged.

    factor 0 learns from positive samples only (the seeds' "+1/-1 to +1/0"); in the spirit of LLDS
    (arXiv:2512.04220), which traces GRPO collapse to the likelihood decay that the penalty on
    negative samples drives, though LLDS itself regularises likelihood rather than scaling."""
    return [a * factor if a < 0 else a for a in adv]
