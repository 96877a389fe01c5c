"""PPO clipped surrogate with IcePop / TIS train-inference correction, token-level terms.

All functions work on flat per-token tensors; aggregation weights (`scale`) are precomputed per
token so that micro-batch accumulation gives exactly the global-batch loss.
"""

from __future__ import annotations

import torch


def mismatch_weights(logp_old: torch.Tensor, logp_infer: torch.Tensor, mode: str,
                     alpha: float = 0.5, beta: float = 5.0, cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight for the train/inference mismatch, and which tokens were masked.

    k = exp(logp_train_old - logp_infer), detached.
    icepop: M(k) = k if alpha <= k <= beta else 0 (Ring-1T).
    tis:    min(k, cap) (truncated importance sampling).
    off:    1.
    """
    k = torch.exp(logp_old.detach() - logp_infer.detach())
    if mode == "icepop":
        inside = (k >= alpha) & (k <= beta)
        return torch.where(inside, k, torch.zeros_like(k)), ~inside
    if mode == "tis":
        return torch.clamp(k, max=cap), torch.zeros_like(k, dtype=torch.bool)
    if mode == "off":
        return torch.ones_like(k), torch.zeros_like(k, dtype=torch.bool)
    raise ValueError(f"unknown mismatch correction {mode!r}")


def ppo_token_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                   eps_low: float = 0.2, eps_high: float = 0.2,
                   dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), and clip flags.

    dual_clip c > 1 bounds the loss of negative-advantage tokens by -c A (Ye et al. 2020).
    """
    ratio = torch.exp(logp - logp_old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, was_clipped


def aggregation_scale(lengths: list[int], mode: str) -> list[torch.Tensor]:
    """Per-token factors that turn a sum of token losses into the aggregated batch loss.

    token_mean:            every token counts 1 / (all tokens of the batch).
    seq_mean_token_mean:   mean over sequences of each sequence's token mean.
    Masked tokens (IcePop) keep their place in these normalisers.
    """
    total = sum(lengths)
    if mode == "token_mean":
        return [torch.full((n,), 1.0 / total) for n in lengths]
    if mode == "seq_mean_token_mean":
        return [torch.full((n,), 1.0 / (n * len(lengths))) for n in lengths]
    raise ValueError(f"unknown loss aggregation {mode!r}")


def offpolicy_sequence_keep(adv: list[float], logp_old: list[torch.Tensor], logp_infer: list[torch.Tensor],
                            delta: float | None) -> list[bool]:
    """DeepSeek-V3.2 off-policy sequence mask: drop a negative-advantage sequence whose mean
    log(pi_infer / pi_old) exceeds delta (the sampler diverged too far from the trainer)."""
    if delta is None:
        return [True] * len(adv)
    return [not (a < 0 and float((li - lo).mean()) > delta) for a, lo, li in zip(adv, logp_old, logp_infer, strict=True)]


def policy_loss(logp: torch.Tensor, f: dict[str, torch.Tensor], eps_low: float, eps_high: float,
                dual_clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over tokens of weight * PPO term * scale; `f` holds per-token logp_old, adv, weight, scale."""
    tok_loss, was_clipped = ppo_token_loss(logp, f["logp_old"], f["adv"], eps_low, eps_high, dual_clip)
    loss = (tok_loss * f["weight"] * f["scale"]).sum()
    stats = {"clipped_tokens": float(was_clipped.sum()), "tokens": float(logp.numel())}
    return loss, stats
