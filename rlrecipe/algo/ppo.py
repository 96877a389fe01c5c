"""PPO clipped surrogate with IcePop / TIS train-inference correction, token-level terms.

All functions work on flat per-token tensors; aggregation weights (`scale`) are precomputed per
token so that micro-batch accumulation gives exactly the global-batch loss.
"""

from __future__ import annotations

import torch

# Log-ratios are clamped before exp (as peers do, at +-20) so one extreme token cannot make an inf.
LOG_RATIO_CLAMP = 20.0


def safe_ratio(logp_num: torch.Tensor, logp_den: torch.Tensor) -> torch.Tensor:
    """exp(logp_num - logp_den) with the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    return torch.exp(torch.clamp(logp_num - logp_den, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def mismatch_weights(logp_old: torch.Tensor, logp_infer: torch.Tensor, mode: str,
                     alpha: float = 0.5, beta: float = 5.0, cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight for the train/inference mismatch, and which tokens were masked.

    k = exp(logp_train_old - logp_infer), detached.
    icepop: M(k) = k if alpha <= k <= beta else 0 (Ring-1T).
    tis:    min(k, cap) (truncated importance sampling).
    off:    1.
    """
    k = safe_ratio(logp_old.detach(), logp_infer.detach())
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
                   dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), with flags of
    the tokens the clip bound and of those the dual clip bound.

    dual_clip c > 1 bounds the loss of negative-advantage tokens by -c A (Ye et al. 2020).
    """
    ratio = safe_ratio(logp, logp_old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual_clipped = torch.zeros_like(was_clipped)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_clipped = (adv < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return loss, was_clipped, dual_clipped


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


def offpolicy_token_drop(logp: torch.Tensor, logp_infer: torch.Tensor, adv: torch.Tensor, seq: torch.Tensor,
                        delta: float) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence mask, per token: True for every token of a sequence with
    a negative advantage whose mean log(pi_infer / pi_theta) over its tokens exceeds delta.

    pi_theta is the policy being updated, so each PPO minibatch decides again with its current
    log-probs (detached: the decision carries no gradient). `seq` numbers the sequences."""
    ids, inverse = torch.unique(seq, return_inverse=True)
    gap = (logp_infer - logp.detach()).float()
    sums = torch.zeros(len(ids), dtype=gap.dtype, device=gap.device).index_add_(0, inverse, gap)
    counts = torch.zeros(len(ids), dtype=gap.dtype, device=gap.device).index_add_(0, inverse, torch.ones_like(gap))
    return (adv < 0) & ((sums / counts)[inverse] > delta)


def policy_loss(logp: torch.Tensor, f: dict[str, torch.Tensor], eps_low: float, eps_high: float,
                dual_clip: float | None = None, offpolicy_delta: float | None = None,
                early_stop_ratio: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over tokens of weight * PPO term * scale; `f` holds per-token logp_old, adv, weight
    (IcePop / TIS), scale, and for the V3.2 mask logp_infer and seq.

    early_stop_ratio: a micro-batch whose mean importance ratio pi_theta/pi_old over its active
    tokens exceeds it contributes no gradient (its loss is multiplied by 0), as AReaL does with
    early_stop_imp_ratio. Stats count only active tokens (weight != 0) as clipped."""
    tok_loss, was_clipped, dual_clipped = ppo_token_loss(logp, f["logp_old"], f["adv"], eps_low, eps_high, dual_clip)
    weight = f["weight"]
    stats: dict[str, float] = {}
    if offpolicy_delta is not None:
        drop = offpolicy_token_drop(logp, f["logp_infer"], f["adv"], f["seq"], offpolicy_delta)
        weight = torch.where(drop, torch.zeros_like(weight), weight)
        stats["offpolicy_dropped_seqs"] = float(torch.unique(f["seq"][drop]).numel())
    active = weight != 0
    loss = (tok_loss * weight * f["scale"]).sum()
    ratio = safe_ratio(logp.detach(), f["logp_old"])
    ratio_sum = float(ratio[active].sum())
    stopped = early_stop_ratio is not None and bool(active.any()) and ratio_sum / float(active.sum()) > early_stop_ratio
    if stopped:
        loss = loss * 0.0
    stats.update({"clipped_tokens": float((was_clipped & active).sum()),
                  "dual_clipped_tokens": float((dual_clipped & active).sum()),
                  "active_tokens": float(active.sum()), "tokens": float(logp.numel()),
                  "ratio_sum": ratio_sum, "early_stopped_microbatches": float(stopped), "microbatches": 1.0})
    return loss, stats
