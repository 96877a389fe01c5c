"""Per-token estimators of KL(pi_theta || pi_ref) on tokens sampled from the policy.

With log rho = logp_ref - logp_theta (Schulman, "Approximating KL divergence", 2020):
    k1 = -log rho                    unbiased value, high variance, can be negative
    k2 = (log rho)^2 / 2             biased value, low variance
    k3 = rho - 1 - log rho           unbiased value, low variance, never negative

k3_unbiased (DeepSeek-V3.2 technical report, Sec. 3.1 "Unbiased KL Estimate"): the tokens come from
pi_old, not pi_theta, so k3 is weighted by the importance ratio pi_theta / pi_old. The ratio is NOT
detached: its gradient is what makes the estimator's gradient unbiased. Per token,
d/d logp [r (rho - 1 - log rho)] = r log(pi_theta / pi_ref), whose expectation under pi_old is
grad KL(pi_theta || pi_ref); with the ratio detached the expectation would be
grad KL(pi_ref || pi_theta) instead (the plain k3 gradient), which is the bias the paper removes.
In the loss (algo/ppo.py) the tokens were sampled by the behaviour policy pi_infer, not pi_old: the
term is weighted as the policy term is, by the behaviour correction (IcePop's or TIS's
k = pi_old / pi_infer, 1 with the correction off), so pi_infer -> pi_old -> pi_theta together.
"""

from __future__ import annotations

import torch

from rlrecipe.algo.ratio import LOG_RATIO_CLAMP, safe_ratio

ESTIMATORS = ("k1", "k2", "k3", "k3_unbiased")


def kl_to_reference(logp: torch.Tensor, logp_ref: torch.Tensor, logp_old: torch.Tensor | None,
                    estimator: str) -> torch.Tensor:
    """Per-token KL estimate, differentiable in logp; logp_old is needed by k3_unbiased only."""
    log_rho = torch.clamp(logp_ref - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    k3 = torch.exp(log_rho) - 1 - log_rho
    if estimator == "k3":
        return k3
    if estimator == "k3_unbiased":
        if logp_old is None:
            raise ValueError("k3_unbiased needs logp_old")
        return safe_ratio(logp, logp_old) * k3
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")
