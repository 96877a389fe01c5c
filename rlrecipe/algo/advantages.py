"""Critic-free advantages: gamma = lambda = 1, so every response token gets its sequence's reward."""

from __future__ import annotations

from collections import defaultdict

import torch

EPS = 1e-5


def sequence_advantages(rewards: list[float], lengths: list[int], group_ids: list[str], mode: str) -> list[float]:
    """One advantage per sequence (shared by all its tokens).

    global: (R - mean) / (std + 1e-5) with mean and std over all valid tokens of the batch
            (each sequence weighs by its length) - AReaL-boba's default.
    group:  GRPO-style, over the sequences of each prompt group.
    none:   the raw reward.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    if mode == "none":
        return r.tolist()
    if mode == "global":
        w = torch.tensor(lengths, dtype=torch.float64)
        mean = (r * w).sum() / w.sum()
        std = torch.sqrt(((r - mean) ** 2 * w).sum() / w.sum())
        return ((r - mean) / (std + EPS)).tolist()
    if mode == "group":
        members: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(group_ids):
            members[g].append(i)
        out = torch.zeros_like(r)
        for idx in members.values():
            rg = r[idx]
            std = rg.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0, dtype=torch.float64)
            out[idx] = (rg - rg.mean()) / (std + EPS)
        return out.tolist()
    raise ValueError(f"unknown advantage normalisation {mode!r}")


def scale_negative_advantages(adv: list[float], factor: float) -> list[float]:
    """Negative advantages times `factor`, after normalisation; positive ones unchanged.

    factor 0 learns from positive samples only (the seeds' "+1/-1 to +1/0"); in the spirit of LLDS
    (arXiv:2512.04220), which traces GRPO collapse to the likelihood decay that the penalty on
    negative samples drives, though LLDS itself regularises likelihood rather than scaling."""
    return [a * factor if a < 0 else a for a in adv]
