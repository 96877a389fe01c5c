"""The GPU cost model built from a model's size and a device's datasheet, with its two efficiencies
fitted to published measurements (bench/data/published/, `python -m bench.projection.published`).

Every term of `CostModel` is a roofline term divided by a share of the device's peak that real
engines reach:

- a decoding step reads the weights once: bytes / (DECODE_SHARE x HBM bandwidth), plus
  STEP_OVERHEAD_S of scheduling and launches; each row adds 2N FLOP at DECODE_SHARE of the bf16
  peak, each context token its K and V at DECODE_SHARE of the bandwidth; a prefilled token costs 2N
  FLOP at that share too;
- a trained token costs (8/6) x (6N + 12 x layers x hidden x T) FLOP (torchtitan's count of a
  trained token, T its sequence length; 8/6 for the RL step's recomputed old log-probs) at
  TRAIN_SHARE of the bf16 peak.

The two shares, the devices' datasheets and the FLOP counts live in rlrecipe/checks/gpu_costs.py,
which `rlrecipe fit`'s closed forms read too; `fit_share` fits the shares to the SGLang and torchtitan
cases. The other constants here are named assumptions the cases cannot separate.
"""

from __future__ import annotations

import math

from bench.projection.sim import CostModel
from rlrecipe.checks.gpu_costs import (
    DECODE_SHARE,
    STEP_OVERHEAD_S,
    TRAIN_SHARE,
    Device,
    train_flops_per_token,
)
from rlrecipe.checks.model_dims import ModelDims

# ASSUMPTION (the former model's): one scheduler iteration per prefill batch
PREFILL_CALL_S = 2.0e-3
# ASSUMPTION (the former model's, not measured): the optimizer step, and a weight push where a projection has no push model
TRAIN_STEP_S = 3.0
PUSH_S = 2.0


def dims_of(cfg: dict) -> ModelDims:
    return ModelDims.from_config(cfg)


def gpu_cost(d: ModelDims, device: Device, *, decode_share: float = DECODE_SHARE, train_share: float = TRAIN_SHARE,
             train_seq_len: float = 8192.0, label: str = "") -> CostModel:
    """The cost model of one engine / one training GPU of `device` for a model of dims `d` in bf16."""
    n = d.params()
    bw, fl = decode_share * device.hbm_bps, decode_share * device.bf16_flops
    return CostModel(
        step_s=2 * n / bw + STEP_OVERHEAD_S, row_s=2 * n / fl, ctx_s=d.kv_bytes_per_token(2) / bw,
        prefill_call_s=PREFILL_CALL_S, prefill_token_s=2 * n / fl, prefill_cell_s=0.0, refill_cell_s=0.0,
        train_step_s=TRAIN_STEP_S, train_token_s=train_flops_per_token(d, train_seq_len) / (train_share * device.bf16_flops),
        push_s=PUSH_S,
        label=label or (f"fitted: {n / 1e9:.2f}B params, bf16, {device.source}; decode share {decode_share:.3f}, "
                        f"train share {train_share:.3f} (bench/projection/cost_model.py)"))


def fit_share(predict, reported: list[float], lo: float = 0.02, hi: float = 1.0) -> tuple[float, list[float]]:
    """The share s in [lo, hi] that minimises the squared log errors of predict(s) (a list, one per
    case) against `reported` (relative errors weigh alike); returns s and the relative residuals
    (predicted / reported - 1). Each prediction falls as s grows, so a golden-section search suffices."""
    def loss(s: float) -> float:
        return sum(math.log(p / r) ** 2 for p, r in zip(predict(s), reported, strict=True))

    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if loss(math.exp(c)) < loss(math.exp(d)):
            b = d
        else:
            a = c
    s = math.exp((a + b) / 2)
    return s, [p / r - 1 for p, r in zip(predict(s), reported, strict=True)]
