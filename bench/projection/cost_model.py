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

DECODE_SHARE and TRAIN_SHARE are fitted (`fit_decode_share`, `fit_train_share`) to the SGLang and
torchtitan cases; the other constants are named assumptions the cases cannot separate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.projection.sim import CostModel
from rlrecipe.checks.model_dims import ModelDims


@dataclass(frozen=True)
class Device:
    hbm_bps: float
    bf16_flops: float
    source: str


DEVICES = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (the H800 has the same)
    "H100": Device(3.35e12, 989e12, "NVIDIA H100 datasheet (SXM5): 3.35 TB/s, 989 TFLOP/s dense bf16"),
    # torchtitan's H100s: 96 GB HBM2e at 2.4 TB/s (docs/performance.md); their peak is stated to lie between
    # SXM and NVL at a 500 W limit, taken as the SXM peak, as torchtitan's own MFU takes it
    "H100-HBM2e-500W": Device(2.4e12, 989e12, "pytorch/torchtitan docs/performance.md: 2.4 TB/s; SXM peak as torchtitan takes it"),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: 2,039 GB/s HBM2e, 312 TFLOP/s dense bf16
    "A100-80GB": Device(2.039e12, 312e12, "NVIDIA A100 datasheet (80GB SXM): 2.039 TB/s, 312 TFLOP/s dense bf16"),
}

# ASSUMPTION (the former H100 model's, not fitted: one decode throughput cannot tell it from DECODE_SHARE):
# scheduling, sampling and kernel launches of one decoding step
STEP_OVERHEAD_S = 1.2e-3
# ASSUMPTION (the former model's): one scheduler iteration per prefill batch
PREFILL_CALL_S = 2.0e-3
# ASSUMPTION (the former model's, not measured): the optimizer step, and a weight push where a projection has no push model
TRAIN_STEP_S = 3.0
PUSH_S = 2.0
# FITTED by `python -m bench.projection.published --fit` (bench/data/published/sglang_llama31_8b_a100_*.json):
# the share of a device's roofline (HBM for weights and KV, bf16 peak for the rows) an SGLang decoding step reaches
DECODE_SHARE = 0.7678
# FITTED the same way (bench/data/published/torchtitan_llama31_8b_fsdp_*.json): the share of the bf16 peak a
# ZeRO-3-like (FSDP) training step sustains, counted as torchtitan counts a token's FLOP
TRAIN_SHARE = 0.3509
# the residuals of those fits, relative, per case (written by --fit, read by the docs)
FIT_RESIDUALS = {"sglang_llama31_8b_a100_offline": 0.0094, "sglang_llama31_8b_a100_online_itl": 0.0101,
                 "torchtitan_llama31_8b_fsdp_8xh100": -0.0137, "torchtitan_llama31_8b_fsdp_128xh100": 0.0139}


def dims_of(cfg: dict) -> ModelDims:
    return ModelDims.from_config(cfg)


def kv_bytes_per_token(d: ModelDims, dtype_bytes: int = 2) -> int:
    return 2 * d.layers * d.kv_dim * dtype_bytes


def train_flops_per_token(d: ModelDims, seq_len: float, rl: bool = True) -> float:
    """torchtitan's count: 6N + 12 x layers x hidden x T; x 8/6 for an RL step (old log-probs recomputed)."""
    flops = 6 * d.params() + 12 * d.layers * d.hidden * seq_len
    return flops * (8 / 6 if rl else 1)


def gpu_cost(d: ModelDims, device: Device, *, decode_share: float = DECODE_SHARE, train_share: float = TRAIN_SHARE,
             train_seq_len: float = 8192.0, label: str = "") -> CostModel:
    """The cost model of one engine / one training GPU of `device` for a model of dims `d` in bf16."""
    n = d.params()
    bw, fl = decode_share * device.hbm_bps, decode_share * device.bf16_flops
    return CostModel(
        step_s=2 * n / bw + STEP_OVERHEAD_S, row_s=2 * n / fl, ctx_s=kv_bytes_per_token(d) / bw,
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
