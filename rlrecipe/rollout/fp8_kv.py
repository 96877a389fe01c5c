"""An FP8 KV cache for the in-process engine, with SGLang's per-tensor scales (rollout.kv_cache_dtype).

Each layer has one scale for its keys and one for its values (SGLang's k_scale / v_scale). A write
stores x / scale cast to FP8, saturating at the format's largest finite value (a plain cast gives
NaN in e4m3fn and inf in e5m2); a read gives fp8.to(float32) x scale in the engine's dtype.

Scales (rollout.kv_scales):
- "unit": 1.0 everywhere, what SGLang uses when the checkpoint carries no scales (an RL export never
  does). Keys or values beyond the format's range saturate; those below its smallest subnormal
  (2^-9 in e4m3, 2^-16 in e5m2) flush to zero.
- "calibrated": after every weight push, before the next generation, the calibration batch runs
  through the model and each layer's scale becomes amax(|K|) / fp8_max (resp. V): the
  max-calibration that llm-compressor and ModelOpt apply to calibration data. K is taken as the
  cache stores it (after RoPE and any k_norm). The batch is CALIBRATION_ROWS x CALIBRATION_TOKENS
  token ids drawn from a fixed seed over the vocabulary: the same batch after every push, so the
  scales move with the weights alone, and no dependence on the data or the step. Random tokens
  are not text; a value beyond the calibrated amax during generation saturates, as it would in
  a tool's calibration on too small a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FORMATS)
KV_SCALES = ("unit", "calibrated")
CALIBRATION_ROWS = 4
CALIBRATION_TOKENS = 64
CALIBRATION_SEED = 0
TINY = 1e-12  # a layer whose calibration amax is 0 (all-zero K/V) keeps a positive scale


def fp8_max(fmt: torch.dtype) -> float:
    return float(torch.finfo(fmt).max)


def quantize(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """x / scale in FP8, saturated at the format's largest finite value."""
    top = fp8_max(fmt)
    return (x.float() / scale).clamp(-top, top).to(fmt)


def dequantize(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


def calibration_ids(vocab_size: int) -> torch.Tensor:
    """The fixed calibration batch: [CALIBRATION_ROWS, CALIBRATION_TOKENS] ids from CALIBRATION_SEED."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (CALIBRATION_ROWS, CALIBRATION_TOKENS), generator=gen)


@dataclass
class KVQuant:
    """The cache's FP8 format and each layer's (k_scale, v_scale); `stale`: a push since calibration."""

    fmt: torch.dtype
    calibrated: bool
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
    stale: bool = True

    @classmethod
    def of(cls, kv_cache_dtype: str, kv_scales: str) -> KVQuant | None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if kv_scales not in KV_SCALES:
            raise ValueError(f"kv_scales {kv_scales!r}: expected one of {', '.join(KV_SCALES)}")
        if kv_cache_dtype == "auto":
            if kv_scales == "calibrated":
                raise ValueError("kv_scales calibrated needs an FP8 kv_cache_dtype (fp8_e4m3 or fp8_e5m2)")
            return None
        return cls(FORMATS[kv_cache_dtype], kv_scales == "calibrated")

    def scales(self, layer: int) -> tuple[float, float]:
        if not self.calibrated:
            return 1.0, 1.0
        return self.k_scales[layer], self.v_scales[layer]

    @torch.no_grad()
    def calibrate(self, model: torch.nn.Module, cache_kw: str) -> None:
        """Each layer's scales from the current weights: amax over the calibration batch / fp8_max."""
        from transformers import DynamicCache

        ids = calibration_ids(model.config.vocab_size)
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kw: cache}, use_cache=True,
              logits_to_keep=1)
        top = fp8_max(self.fmt)
        self.k_scales = [max(float(layer.keys.abs().amax()) / top, TINY) for layer in cache.layers]
        self.v_scales = [max(float(layer.values.abs().amax()) / top, TINY) for layer in cache.layers]
        self.stale = False
