"""Importance ratios from log-probabilities, bounded so one extreme token cannot make an inf."""

from __future__ import annotations

import torch

# Log-ratios are clamped before exp (as peers do, at +-20) so one extreme token cannot make an inf.
LOG_RATIO_CLAMP = 20.0


def safe_ratio(logp_num: torch.Tensor, logp_den: torch.Tensor) -> torch.Tensor:
    """exp(logp_num - logp_den) with the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    return torch.exp(torch.clamp(logp_num - logp_den, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
