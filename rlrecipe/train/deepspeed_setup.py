"""What the DeepSpeed engine sets up before `deepspeed.initialize`: the config a recipe's trainer
section asks for, the model loaded (partitioned as it loads under ZeRO-3), and the optimizer.

Loading: under ZeRO-3 the weights are partitioned as they load (`zero.Init`), so no rank ever
holds the whole model; under ZeRO-1/2 every rank holds a full copy anyway (only optimizer state
and gradients are sharded).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from pathlib import Path
from typing import Any

import torch

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_model
from rlrecipe.recipe.systems import TrainerSection


def skip_cpu_shm_comm_build() -> None:
    """On CPU, DeepSpeed's comm backend compiles a shared-memory all-reduce op (~70 s on 2 cores) that
    only inference all-reduce uses; training never calls it and falls back to gloo without it.
    Skip the build unless RLRECIPE_DS_SHM_COMM=1. No effect on GPU (no such op there)."""
    if torch.cuda.is_available() or os.environ.get("RLRECIPE_DS_SHM_COMM") == "1":
        return
    import importlib

    # (`import deepspeed.comm.torch as m` would bind torch itself: deepspeed.comm has a `torch` attribute)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def build_ds_config(cfg: TrainerSection, dtype: str, world: int, overrides: dict | None = None) -> dict[str, Any]:
    """The DeepSpeed config for a recipe's trainer section (one micro-batch, boundaries set by hand)."""
    if cfg.zero_stage == 0:
        raise UserError("trainer.zero_stage: 0 is plain data parallelism; the DeepSpeed engine needs ZeRO stage "
                        "1, 2 or 3 (or use trainer.engine: torch in one process)")
    if cfg.offload_params and cfg.zero_stage != 3:
        raise UserError(f"trainer.offload_params needs trainer.zero_stage: 3 (got {cfg.zero_stage})")
    zero: dict[str, Any] = {"stage": cfg.zero_stage}  # DeepSpeed's defaults for buckets, overlap, prefetch
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif dtype == "float16":
        # loss_scale 0 = dynamic; AReaL's settings (train/loss_scale.py follows the same rules)
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 5,
                          "hysteresis": 2, "min_loss_scale": 1}
    return _merge(config, overrides or {})


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.contextmanager
def plain_cuda_arch_list():
    """TORCH_CUDA_ARCH_LIST without architecture suffixes while DeepSpeed builds an op: its builder
    (0.19.8) reads "9.0a", which Hopper images set, as a number and fails; FusedAdam needs no
    arch-specific instruction, so "9.0" builds the same kernel."""
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if before:
        os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", before)
    try:
        yield
    finally:
        if before is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before


def load_for_zero(model_dir: str | Path, dtype: str, attn_implementation: str, ds_config: dict,
                  zero3: bool) -> tuple[torch.nn.Module, bool]:
    """The model, and whether it loaded partitioned. ZeRO-3: each rank materialises only its
    partition while loading (zero.Init through transformers' DeepSpeed integration), so host memory
    holds one copy of the weights across ranks instead of one per rank. The integration is switched
    on for this load only: while it is on, every from_pretrained in the process (e.g. the rollout
    engine's) would be partitioned."""
    if not zero3:
        return load_model(model_dir, dtype, attn_implementation), False
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    switch = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference to it
    try:
        model = load_model(model_dir, dtype, attn_implementation)
    finally:
        del switch
    return model, all(hasattr(p, "ds_id") for p in model.parameters())


def make_optimizer(trainable: list[torch.nn.Parameter], cfg: TrainerSection, fused: bool) -> torch.optim.Optimizer:
    """AdamW with the recipe's settings; `fused`: DeepSpeed's FusedAdam, a CUDA kernel of the same
    update, which ZeRO-3 needs to move its state off the GPU (offload_states)."""
    if fused:
        from deepspeed.ops.adam import FusedAdam

        with plain_cuda_arch_list():
            return FusedAdam(trainable, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay, adam_w_mode=True)
    return torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
