"""PPO clipped surrogate with IcePop / TIS train-inference correction, token-level terms.

All functions work on flat per-token tensors; aggregation weights (`scale`) are precomputed per
token so that micro-batch accumulation gives exactly the global-batch loss. The stability remedies
(GSPO, Clip-Cov / KL-Cov, KL to a reference, entropy bonus) live in their own modules; `policy_loss`
applies the ones `Remedies` turns on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrecipe.algo.columns import LossStats, TokenColumns
from rlrecipe.algo.cov import clip_cov_tokens, kl_cov_penalty, kl_cov_tokens, token_covariance
from rlrecipe.algo.gspo import sequence_log_ratio
from rlrecipe.algo.kl import kl_to_reference
from rlrecipe.algo.ratio import LOG_RATIO_CLAMP, safe_ratio

__all__ = ["LOG_RATIO_CLAMP", "LossSettings", "LossStats", "Remedies", "TokenColumns", "aggregation_scale", "mismatch_weights", "offpolicy_token_drop",
           "policy_loss", "ppo_token_loss", "safe_ratio"]


@dataclass(frozen=True)
class Remedies:
    """Stability options the loss applies beside clipping; the defaults change nothing.

    ratio_level "sequence": GSPO's sequence ratio with its own clip range (algo/gspo.py).
    cov_mode "clip_cov" / "kl_cov": Cui et al. 2025 on cov_fraction of the tokens (algo/cov.py).
    kl_coef > 0: + kl_coef x KL(pi_theta || pi_ref) per token, aggregated as the loss (algo/kl.py),
    on every token (a regulariser: not weighted by IcePop / TIS); needs the field logp_ref.
    entropy_coef > 0: - entropy_coef x entropy of the active tokens, aggregated as the loss; needs
    the field entropy (with gradient)."""

    ratio_level: str = "token"
    seq_eps_low: float = 3e-4
    seq_eps_high: float = 4e-4
    cov_mode: str = "off"
    cov_fraction: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class LossSettings:
    """Everything the policy loss is told besides its columns: PPO's clip range, the dual clip, the
    V3.2 mask's delta and the remedies. rl.py builds it once from the recipe.

    stopped: the PPO minibatch was early-stopped (decided over the whole minibatch, before its
    update: `importance_ratio_sums`): the loss is multiplied by 0, its statistics kept."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    offpolicy_delta: float | None = None
    remedies: Remedies = Remedies()
    stopped: bool = False


def mismatch_weights(logp_old: torch.Tensor, logp_infer: torch.Tensor, mode: str,
                     alpha: float = 0.5, beta: float = 5.0, cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight for the train/inference mismatch, and which tokens were masked.

    k = exp(logp_train_old - logp_infer), detached.
    icepop: M(k) = k if alpha <= k <= beta else 0 (Ring-1T).
    tis:    min(k, cap) (truncated importance sampling).
    m2po:   k; the batch-level mask is algo/m2po.py's, applied by the caller.
    off:    1.
    """
    k = safe_ratio(logp_old.detach(), logp_infer.detach())
    if mode == "icepop":
        inside = (k >= alpha) & (k <= beta)
        return torch.where(inside, k, torch.zeros_like(k)), ~inside
    if mode == "tis":
        return torch.clamp(k, max=cap), torch.zeros_like(k, dtype=torch.bool)
    if mode == "m2po":
        return k, torch.zeros_like(k, dtype=torch.bool)
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


def loss_weight(logp: torch.Tensor, cols: TokenColumns, settings: LossSettings) -> tuple[torch.Tensor, float]:
    """Each token's weight in the loss (IcePop/TIS's, less the V3.2 mask's drops under the current
    log-probs) and how many sequences the mask dropped."""
    (weight,) = cols.need("weight")
    if settings.offpolicy_delta is None:
        return weight, 0.0
    adv, logp_infer, seq = cols.need("adv", "logp_infer", "seq")
    drop = offpolicy_token_drop(logp, logp_infer, adv, seq, settings.offpolicy_delta)
    return torch.where(drop, torch.zeros_like(weight), weight), float(torch.unique(seq[drop]).numel())


def importance_ratio_sums(logp: torch.Tensor, cols: TokenColumns, settings: LossSettings) -> tuple[float, float]:
    """Sum of pi_theta / pi_old over the tokens that train (weight != 0) and their count: AReaL's
    early stop compares the mean with early_stop_imp_ratio."""
    weight, _ = loss_weight(logp, cols, settings)
    active = weight != 0
    (logp_old,) = cols.need("logp_old")
    return float(safe_ratio(logp.detach(), logp_old)[active].sum()), float(active.sum())


def policy_loss(logp: torch.Tensor, cols: TokenColumns, settings: LossSettings = LossSettings(),
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, LossStats]:
    """Sum over tokens of weight * PPO term * scale, from the columns logp_old, adv, weight and scale
    (and logp_infer, seq for the V3.2 mask and GSPO; see `Remedies` for the rest; `generator` draws
    Clip-Cov's tokens).

    Stats count only active tokens (weight != 0) as clipped."""
    rem = settings.remedies
    logp_old, adv, weight, scale = cols.need("logp_old", "adv", "weight", "scale")
    stats = LossStats(microbatches=1.0, tokens=float(logp.numel()))
    if rem.ratio_level == "sequence":
        (seq,) = cols.need("seq")
        log_s = sequence_log_ratio(logp, logp_old, seq)
        tok_loss, was_clipped, dual_clipped = ppo_token_loss(log_s, torch.zeros_like(log_s), adv,
                                                             rem.seq_eps_low, rem.seq_eps_high, settings.dual_clip)
        stats.seqs, stats.seq_ratio_sum, stats.seq_clipped = _sequence_stats(log_s.detach(), was_clipped, seq)
    elif rem.ratio_level == "token":
        tok_loss, was_clipped, dual_clipped = ppo_token_loss(logp, logp_old, adv, settings.eps_low, settings.eps_high,
                                                             settings.dual_clip)
    else:
        raise ValueError(f"unknown ratio level {rem.ratio_level!r}")
    weight, stats.offpolicy_dropped_seqs = loss_weight(logp, cols, settings)
    active = weight != 0
    if rem.cov_mode != "off":
        tok_loss, chosen = _cov_remedy(tok_loss, logp, cols, active & ~was_clipped & ~dual_clipped, rem, generator)
        stats.cov_selected_tokens = float(chosen.sum())
    loss = (tok_loss * weight * scale).sum()
    if rem.kl_coef > 0:
        (logp_ref,) = cols.need("logp_ref")
        kl = kl_to_reference(logp, logp_ref, logp_old, rem.kl_estimator)
        if rem.kl_estimator == "k3_unbiased":
            # its ratio corrects pi_old to pi_theta; the tokens came from the behaviour policy (the
            # inference engine, and under rl.async_lag older weights), which the policy term's
            # behaviour weight k = pi_old / pi_infer corrects: the KL term takes the same weight
            kl = kl * weight
        loss = loss + rem.kl_coef * (kl * scale).sum()
        stats.kl_ref_sum = float(kl.detach().sum())
    if rem.entropy_coef > 0:
        (entropy,) = cols.need("entropy")
        bonus = rem.entropy_coef * (entropy * active * scale).sum()
        loss = loss - bonus
        stats.entropy_bonus = float(bonus.detach())
    ratio = safe_ratio(logp.detach(), logp_old)
    stats.ratio_sum = float(ratio[active].sum())
    if settings.stopped:
        loss = loss * 0.0
    stats.clipped_tokens = float((was_clipped & active).sum())
    stats.dual_clipped_tokens = float((dual_clipped & active).sum())
    stats.active_tokens = float(active.sum())
    return loss, stats


def _sequence_stats(log_s: torch.Tensor, was_clipped: torch.Tensor, seq: torch.Tensor) -> tuple[float, float, float]:
    """GSPO: how many sequences, the sum of their ratios s_i, and how many the clip bound."""
    # every token of a sequence carries the same s_i and the same clip flag: any one of them will do
    ids, inverse = torch.unique(seq, return_inverse=True)
    s_i = torch.zeros(len(ids), dtype=log_s.dtype, device=log_s.device).scatter_(0, inverse, log_s.exp())
    clipped = torch.zeros(len(ids), dtype=torch.bool, device=log_s.device).scatter_(0, inverse, was_clipped)
    return float(len(ids)), float(s_i.sum()), float(clipped.sum())


def _cov_remedy(tok_loss: torch.Tensor, logp: torch.Tensor, cols: TokenColumns, candidates: torch.Tensor,
                rem: Remedies, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov detaches the chosen tokens' terms; KL-Cov adds its penalty to them (then weighted like
    the rest of the term). Candidates are the tokens still in the loss and held by neither clip: the
    authors' code for Clip-Cov; for KL-Cov, whose authors drop the clip and rank every token, a
    variant (algo/cov.py says why)."""
    cov = token_covariance(logp, cols.adv)
    if rem.cov_mode == "clip_cov":
        chosen = clip_cov_tokens(cov, candidates, rem.cov_fraction, rem.clip_cov_low, rem.clip_cov_high, generator)
        return torch.where(chosen, tok_loss.detach(), tok_loss), chosen
    if rem.cov_mode == "kl_cov":
        chosen = kl_cov_tokens(cov, candidates, rem.cov_fraction)
        return tok_loss + chosen * rem.kl_cov_coef * kl_cov_penalty(logp, cols.logp_old), chosen
    raise ValueError(f"unknown covariance remedy {rem.cov_mode!r}")
