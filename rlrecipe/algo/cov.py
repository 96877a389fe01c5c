"""Clip-Cov and KL-Cov token selection (Cui et al. 2025, "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models", arXiv:2505.22617, Sec. 4.3).

Entropy falls when actions with high log-probability also have high advantage; per token the
covariance term is

    cov_i = (logp_i - mean_j logp_j) * (A_i - mean_j A_j)                      (Eq. 11)

with the means over the N tokens of the batch. Here the batch is the micro-batch that the loss
function sees (as in the authors' code, where the policy-loss function computes it on each
micro-batch with the current, detached log-probs): a global-batch version would need a pass over
the whole minibatch before the update.

Clip-Cov (Eq. 12): draw floor(r N) tokens at random among the candidates with cov in
[omega_low, omega_high] and detach their gradient. KL-Cov (Eq. 13): the top floor(k N) candidates
by cov get a penalty between pi_old and pi_theta, estimated per token as |logp - logp_old| (the
authors' estimate). Both take at least one token, as the authors' code does.

The candidates are chosen by the caller (`ppo._cov_remedy`): the tokens still in the loss (weight
!= 0) that neither the PPO clip nor the dual clip holds. For Clip-Cov that is the authors' code.
KL-Cov here is a variant of theirs: their code drops the PPO clip when KL-Cov is on (the plain
-A r on every token) and ranks every valid token; here the clipped PPO loss stays and only the
candidates are ranked (cov and N still count every token of the micro-batch). Why: every
stability option is one change to the same loss, so a KL-Cov recipe differs from its base in
KL-Cov alone, not also in losing the clip; a token of weight 0 would get its penalty times 0, so
ranking it would waste one of the few places; and a clipped token is already held back, so the
places go to tokens nothing else restrains, as Clip-Cov's do. docs/design.md states the loss.
"""

from __future__ import annotations

import torch


def token_covariance(logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """cov_i of Eq. 11 over the given tokens; no gradient."""
    lp = logp.detach().float()
    a = adv.detach().float()
    return (lp - lp.mean()) * (a - a.mean())


def _count(fraction: float, n_tokens: int) -> int:
    return max(1, int(fraction * n_tokens))


def clip_cov_tokens(cov: torch.Tensor, candidates: torch.Tensor, fraction: float, low: float, high: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip-Cov's I_clip as a mask: floor(fraction * N) tokens (at least one) drawn uniformly from the
    candidates with low <= cov <= high. Drawn on the CPU so a resumed run draws the same tokens."""
    pool = torch.nonzero(candidates & (cov >= low) & (cov <= high)).squeeze(-1).cpu()
    pick = pool[torch.randperm(len(pool), generator=generator)[:_count(fraction, cov.numel())]]
    mask = torch.zeros_like(candidates, dtype=torch.bool)
    mask[pick.to(mask.device)] = True
    return mask


def kl_cov_tokens(cov: torch.Tensor, candidates: torch.Tensor, fraction: float) -> torch.Tensor:
    """KL-Cov's I_KL as a mask: the floor(fraction * N) candidates (at least one) of highest cov."""
    k = min(_count(fraction, cov.numel()), int(candidates.sum()))
    mask = torch.zeros_like(candidates, dtype=torch.bool)
    if k:
        ranked = torch.where(candidates, cov, torch.full_like(cov, -torch.inf))
        mask[torch.topk(ranked, k).indices] = True
    return mask


def kl_cov_penalty(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """The per-token KL(pi_old || pi_theta) estimate KL-Cov adds on its tokens: |logp - logp_old|."""
    return (logp - logp_old).abs()
