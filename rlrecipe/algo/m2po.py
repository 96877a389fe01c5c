"""M2PO's second-moment trust region as a behaviour correction (Zheng et al. 2025, "Prosperity
before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161,
Algorithm 1).

Each token's M2 = (log r)^2, r the ratio of the policy to the behaviour policy; here r = k =
pi_old / pi_infer, the behaviour correction of the decoupled objective, which is pi_theta /
pi_infer at the step's first update. Only trust-region tokens are candidates, those a PPO clip
could bind (A > 0 with r > 1, A < 0 with r < 1). While the mean M2 of the candidates still in
play exceeds the threshold, the largest is masked: a batch-level bound on the second moment that
removes only the outliers. Masked tokens keep their place in the loss's normaliser.
"""

from __future__ import annotations

import torch


def second_moment_mask(log_r: torch.Tensor, adv: torch.Tensor, threshold: float) -> torch.Tensor:
    """True for the tokens M2PO masks, over one flat batch of tokens (log-ratios and advantages)."""
    cand = torch.nonzero(((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0))).flatten()
    mask = torch.zeros(log_r.shape, dtype=torch.bool, device=log_r.device)
    if cand.numel() == 0:
        return mask
    m2 = log_r[cand].double() ** 2
    ordered, order = torch.sort(m2, descending=True, stable=True)  # ties: the earlier token first, as argmax
    # with the j largest masked, the rest's mean is (sum of ordered[j:]) / (n - j)
    rest_sum = ordered.flip(0).cumsum(0).flip(0)
    rest_n = torch.arange(len(ordered), 0, -1, dtype=ordered.dtype, device=ordered.device)
    within = torch.nonzero(rest_sum / rest_n <= threshold).flatten()
    n_masked = int(within[0]) if within.numel() else len(ordered)  # none within: every candidate goes
    mask[cand[order[:n_masked]]] = True
    return mask


def batch_masks(log_rs: list[torch.Tensor], advs: list[torch.Tensor], threshold: float) -> list[torch.Tensor]:
    """`second_moment_mask` over a batch of sequences, given and returned per sequence."""
    flat = second_moment_mask(torch.cat(log_rs), torch.cat(advs), threshold)
    return list(torch.split(flat, [len(x) for x in log_rs]))
