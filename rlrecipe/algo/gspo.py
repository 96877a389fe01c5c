"""GSPO's sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy
Optimization", arXiv:2507.18071).

s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t(logp_t - logp_old_t))      (Eq. 7)

and the objective -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) per sequence, averaged
over sequences (Eq. 5). Written per token in the GSPO-token form (Sec. 4.3, Eq. 13-14),
s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]: every token of sequence i carries the value
s_i, and d s_i,t / d logp_t = s_i, so with the token loss averaged per sequence and then over
sequences (seq_mean_token_mean) the objective, the clipping and the gradient
s_i A_i (1/|y_i|) sum_t grad logp_t are exactly GSPO's (Eq. 10). The PPO token loss applies to it
unchanged.
"""

from __future__ import annotations

import torch


def per_sequence_mean(values: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Each token's value replaced by the mean over the tokens of its sequence (`seq` numbers them)."""
    ids, inverse = torch.unique(seq, return_inverse=True)
    v = values.float()
    sums = torch.zeros(len(ids), dtype=v.dtype, device=v.device).index_add_(0, inverse, v)
    counts = torch.zeros(len(ids), dtype=v.dtype, device=v.device).index_add_(0, inverse, torch.ones_like(v))
    return (sums / counts)[inverse]


def sequence_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """log s_i,t per token: the value is log s_i of the token's sequence, the gradient w.r.t. logp_t is 1."""
    log_s = per_sequence_mean(logp.detach() - logp_old, seq)
    return logp - logp.detach() + log_s
