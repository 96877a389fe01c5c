"""A GPU's datasheet and the shares of it that real engines reach: the one place that `rlrecipe fit`'s
closed forms (step_time.py) and the simulated projections (bench/projection/cost_model.py) take their
GPU rates from.

DECODE_SHARE and TRAIN_SHARE are fitted to published measurements (bench/data/published/, refit with
`python -m bench.projection.published --fit`); every other constant names its source or is marked an
assumption. A share multiplies a roofline term:

- a decoding step reads the weights once at DECODE_SHARE of the HBM bandwidth, each row costs 2N FLOP
  and each prefilled token 2N FLOP at DECODE_SHARE of the bf16 peak, each context token its K and V at
  DECODE_SHARE of the bandwidth;
- a trained token costs 6N + 12 x layers x hidden x T FLOP (torchtitan's count, T the sequence length),
  scaled by the passes a step makes, at TRAIN_SHARE of the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# ASSUMPTION (not fitted: one decode throughput cannot tell it from DECODE_SHARE): scheduling, sampling and
# kernel launches of one decoding step
STEP_OVERHEAD_S = 1.2e-3
# FITTED by `python -m bench.projection.published --fit` (bench/data/published/sglang_llama31_8b_a100_*.json):
# the share of a device's roofline (HBM for weights and KV, bf16 peak for the rows) an SGLang decoding step reaches
DECODE_SHARE = 0.7678
# FITTED the same way (bench/data/published/torchtitan_llama31_8b_fsdp_*.json): the share of the bf16 peak a
# ZeRO-3-like (FSDP) training step sustains, counted as torchtitan counts a token's FLOP
TRAIN_SHARE = 0.3509
# the residuals of those fits, relative, per case (written by --fit, read by the docs)
FIT_RESIDUALS = {"sglang_llama31_8b_a100_offline": 0.0094, "sglang_llama31_8b_a100_online_itl": 0.0101,
                 "torchtitan_llama31_8b_fsdp_8xh100": -0.0137, "torchtitan_llama31_8b_fsdp_128xh100": 0.0139}


def token_flops(d: ModelDims, seq_len: float) -> float:
    """torchtitan's count of one trained token, forward and backward: 6N + 12 x layers x hidden x T."""
    return 6 * d.params() + 12 * d.layers * d.hidden * seq_len


def train_flops_per_token(d: ModelDims, seq_len: float, rl: bool = True) -> float:
    """torchtitan's count, x 8/6 for an RL step (the old log-probs recomputed: one more forward)."""
    return token_flops(d, seq_len) * (8 / 6 if rl else 1)
