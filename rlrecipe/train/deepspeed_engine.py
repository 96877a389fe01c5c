"""DeepSpeed ZeRO training engine: the TorchTrainEngine interface over one or many processes.

Data parallelism and the global batch
-------------------------------------
Every rank calls `train_step(samples, loss_fn)` and `compute_logprobs(samples)` with the same
global batch (the caller computes the per-token `scale` column over that global batch). The
engine splits the samples across ranks, balancing tokens (longest first onto the least-loaded
rank), and each rank packs its share into micro-batches exactly as the torch engine does.

Loss normalisation: each rank's loss is the sum over its micro-batches of per-token terms already
scaled for the global batch, so the global loss is the SUM over ranks. DeepSpeed AVERAGES
gradients over the data-parallel ranks (it divides by the world size when it reduces them), so
every micro-batch loss is multiplied by the world size before `engine.backward`; the reduced
gradient is then exactly the gradient of the global loss, the same one the torch engine computes
in one process. Reported `loss` and the loss_fn's stats are summed over ranks.

Equal collectives: ZeRO-2 reduces gradients in every backward and ZeRO-3 gathers parameters in
every forward, so all ranks must run the same number of forwards and backwards. Ranks with fewer
micro-batches than the busiest one run padding micro-batches (a 2-token dummy sequence whose
loss is multiplied by 0: zero gradient, same collectives). The accumulation boundary is set by
hand (`set_gradient_accumulation_boundary`, True on the last micro-batch only, with
gradient_accumulation_steps 1), then one `engine.step()` per `train_step`.

Optimizer and schedule: torch AdamW with the recipe's lr/betas/eps/weight decay, passed to
DeepSpeed (`zero_allow_untested_optimizer`, so no C++ Adam op is built); the transformers
schedule of the torch engine as DeepSpeed's client scheduler; clipping through DeepSpeed's
`gradient_clipping`. A step whose gradient norm is NaN/inf is skipped by DeepSpeed; the schedule
still advances, as in the torch engine. `model.dtype: bfloat16` enables DeepSpeed bf16 (bf16
weights and compute, fp32 master weights in the optimizer), `float16` enables fp16 with dynamic
loss scaling (AReaL's settings, as the torch engine's scaler: initial scale 2^32, window 5,
hysteresis 2, minimum 1), `float32` trains in fp32; `trainer.bf16_autocast` additionally runs the forward in
torch.autocast, as in the torch engine. ZeRO stage 1, 2 or 3 from `trainer.zero_stage`;
`trainer.offload_optimizer` / `trainer.offload_params` (stage 3) offload to CPU memory.

Checkpoints: `save(dir)` writes DeepSpeed's own checkpoint and each rank's RNG state
(train/deepspeed_checkpoint.py) and a full HF export in `dir/model` (the torch engine's layout).
`load(dir)` restores all of that; it needs the same number of ranks. `export_hf` gathers ZeRO-3
parameters layer by layer onto rank 0, which alone writes; `rollout_state()` returns that gathered
state dict on rank 0, an empty dict elsewhere (train/deepspeed_weights.py).

Setting up (the DeepSpeed config, the model loaded partitioned under ZeRO-3, the optimizer) is
train/deepspeed_setup.py's; the split of the global batch over ranks train/data_parallel.py's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.packing import allocate_microbatches
from rlrecipe.core.dist import barrier
from rlrecipe.modeling import enable_checkpointing
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train import data_parallel, lora
from rlrecipe.train.base import LossFn, StepResult, TrainSample, add_sums
from rlrecipe.train.deepspeed_checkpoint import load_deepspeed_state, save_deepspeed_state
from rlrecipe.train.deepspeed_setup import (
    build_ds_config,
    load_for_zero,
    make_optimizer,
    skip_cpu_shm_comm_build,
)
from rlrecipe.train.deepspeed_weights import DeepSpeedWeights
from rlrecipe.train.launch import init_distributed
from rlrecipe.train.torch_engine import TorchTrainEngine, empty_device_cache, make_scheduler
from rlrecipe.train.varlen_attention import training_attention


class DeepSpeedTrainEngine(TorchTrainEngine):
    """Same interface as TorchTrainEngine; `_forward` and `microbatches` are inherited."""

    def __init__(self, model_dir: str | Path, cfg: TrainerSection, total_steps: int, dtype: str = "float32",
                 temperature: float = 1.0, gradient_checkpointing: bool = False,
                 ds_config_overrides: dict | None = None, attn_implementation: str = "sdpa",
                 colocated: bool = False):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        init_distributed()
        skip_cpu_shm_comm_build()
        deepspeed.init_distributed()  # wraps the group just started; zero.Init needs it before initialize()
        # DeepSpeed calls torch.distributed functions that torch has deprecated; not ours to fix.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        self.cfg = cfg
        self.temperature = temperature
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ds_config = build_ds_config(cfg, dtype, self.world, ds_config_overrides)
        fp16 = self.ds_config.get("fp16", {})
        if fp16.get("enabled") and self.rank == 0:
            from rlrecipe.core.console import console

            console.print(f"fp16: the dynamic loss scale starts at 2^{fp16.get('initial_scale_power')} and is halved "
                          f"on each overflow (raised after {fp16.get('loss_scale_window')} clean steps): the first "
                          "steps may be skipped on overflow until it settles (metrics: overflow, loss_scale)",
                          highlight=False)
        self.zero3 = cfg.zero_stage == 3
        model, self.partitioned_load = load_for_zero(model_dir, dtype, training_attention(attn_implementation),
                                                     self.ds_config, self.zero3)
        if gradient_checkpointing:
            enable_checkpointing(model)
        if cfg.lora.enabled:  # the base frozen: only the adapter has gradients and optimizer state
            model = lora.wrap(model, cfg.lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # ZeRO-3 moves its optimizer's state off the GPU (offload_states, for a colocated rollout) only
        # with DeepSpeed's FusedAdam, a CUDA kernel of the same AdamW update
        self.fused_adam = colocated and self.zero3 and torch.cuda.is_available()
        optimizer = make_optimizer(trainable, cfg, fused=self.fused_adam)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config,
            lr_scheduler=lambda opt: make_scheduler(opt, cfg, total_steps))
        self.model = self.engine  # TorchTrainEngine._forward calls self.model(...)
        self.device = torch.device(get_accelerator().current_device_name())
        self.steps_done = 0
        self.weights = DeepSpeedWeights(self.engine, self.zero3, self.is_lora, self.rank)

    # -- data parallel -------------------------------------------------------------------------
    def shard(self, samples: list[TrainSample]) -> list[int]:
        """Indices of the samples this rank handles: tokens balanced over ranks, data order kept."""
        return data_parallel.shard([len(s.input_ids) for s in samples], self.rank, self.world)

    # -- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainSample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logp, entropy) per sample for its response tokens, on every rank (each computes its share)."""
        self.engine.eval()
        mine = self.shard(samples)
        bins = self.microbatches_of(samples, mine)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(data_parallel.max_over_ranks(len(bins), self.world, self.device)):
            if i >= len(bins):  # keep ZeRO-3's gathers in step
                self._forward(data_parallel.padding_microbatch(), with_entropy=False)
                continue
            mb = [samples[j] for j in bins[i]]
            logp, ent = self._forward(mb, with_entropy=True)
            sizes = [s.num_response for s in mb]
            for j, lp, en in zip(bins[i], logp.split(sizes), ent.split(sizes), strict=True):
                out[j] = (lp.cpu(), en.cpu())
        if self.world > 1:
            parts: list[dict] = [{} for _ in range(self.world)]
            dist.all_gather_object(parts, out)
            for part in parts:
                out.update(part)
        return [out[i] for i in range(len(samples))]

    def microbatches_of(self, samples: list[TrainSample], indices: list[int]) -> list[list[int]]:
        """Packed micro-batches of samples[indices] (as `microbatches` packs), as indices into samples."""
        bins = allocate_microbatches([len(samples[i].input_ids) for i in indices], self.cfg.max_tokens_per_microbatch)
        return [[indices[k] for k in b] for b in bins]

    # -- update --------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample], loss_fn: LossFn, with_entropy: bool = False) -> StepResult:
        """One optimizer step over the global batch; this rank trains on its share.

        with_entropy and the fp16 "overflow" / "loss_scale" stats as in TorchTrainEngine.train_step."""
        if not samples:  # every rank sees the same global batch, so all return here together
            self.scheduler.step()
            self.steps_done += 1
            return StepResult(0.0, 0.0, self.scheduler.get_last_lr()[0], skipped=False)
        self.engine.train()
        bins = self.microbatches_of(samples, self.shard(samples))
        n = max(1, data_parallel.max_over_ranks(len(bins), self.world, self.device))
        stats: dict[str, float] = {}
        local_loss = 0.0
        for i in range(n):
            self.engine.set_gradient_accumulation_boundary(i == n - 1)
            if i < len(bins):
                mb = [samples[j] for j in bins[i]]
                logp, entropy = self._forward(mb, with_entropy=with_entropy)
                cols = TokenColumns.cat([s.columns for s in mb], self.device)
                if with_entropy:
                    cols.entropy = entropy
                loss, mb_stats = loss_fn(logp, cols)
                if not loss.requires_grad:  # a constant loss still has to run the backward collectives
                    loss = loss + logp.sum() * 0.0
                local_loss += float(loss.detach())
                add_sums(stats, mb_stats)
            else:
                logp, _ = self._forward(data_parallel.padding_microbatch(), with_entropy=False)
                loss = logp.sum() * 0.0
            # DeepSpeed averages gradients over ranks; the global loss is their sum.
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
        skipped_before = self.engine.skipped_steps
        fp16 = self.ds_config.get("fp16", {}).get("enabled", False)
        scale = float(self.engine.optimizer.loss_scale) if fp16 else 1.0
        self.engine.step()
        skipped = self.engine.skipped_steps > skipped_before
        if skipped:
            self.scheduler.step()  # DeepSpeed does not advance the schedule on a skipped step; torch engine does
        totals = data_parallel.sum_over_ranks({"loss": local_loss, **stats}, self.world)
        norm = self.engine.get_global_grad_norm()  # before clipping, like torch's clip_grad_norm_
        grad_norm = float("nan") if skipped or norm is None else float(norm)
        self.steps_done += 1
        out = StepResult(totals.pop("loss"), grad_norm, self.scheduler.get_last_lr()[0], skipped=skipped, sums=totals)
        if fp16:
            # a skip at the minimum scale is not an overflow that scaling explains
            out.overflow = skipped and math.isfinite(out.loss) and scale > self.ds_config["fp16"]["min_loss_scale"]
            out.loss_scale = scale
        return out

    # -- colocated layouts ----------------------------------------------------------------------
    def offload_states(self, part: str) -> None:
        """DeepSpeed's offload_states: "optimizer" (moments, fp32 master weights, gradient buffers)
        after the update, "weights" (the low-precision ones) after the push; pinned where CUDA is."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        parts = {"optimizer": [State.optim_states, State.hp_params, State.contiguous_grad_buffer, State.lp_grads],
                 "weights": [State.lp_params]}
        if part not in parts:
            raise ValueError(f"unknown part {part!r}: 'optimizer' or 'weights'")
        if self.zero3 and not self.fused_adam:
            return  # on a CPU device (see __init__): the state already lives in host memory
        if part == "weights" and self.is_lora:
            return  # the frozen base stays on the device in both phases
        self.engine.offload_states(include=parts[part], pin_memory=torch.cuda.is_available())
        empty_device_cache()

    def reload_states(self) -> None:
        self.engine.reload_states()

    # -- state ---------------------------------------------------------------------------------
    def rollout_state(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout engine: on rank 0; an empty dict elsewhere. Collective."""
        return self.weights.full_state_dict()

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the full weights, tied ones once (ZeRO-3: copies on the device). Collective."""
        return self.weights.full_weights()

    def adapter_off(self):
        return lora.base_without_adapter(self.engine.module)

    def adapter_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Under trainer.lora, every rank: the adapter's config and tensors (on the CPU). Collective
        under ZeRO-3 (the adapter is gathered: megabytes)."""
        return self.weights.adapter_state()

    def export_adapter(self, out_dir: str | Path) -> Path:
        """Under trainer.lora: the adapter as a PEFT directory, written by rank 0. Collective."""
        config, tensors = self.adapter_state()
        if self.rank == 0:
            lora.write_adapter(out_dir, config, tensors)
        barrier()
        return Path(out_dir)

    def export_hf(self, out_dir: str | Path, tokenizer=None) -> Path:
        """A full HF safetensors model (and tokenizer) written by rank 0; under trainer.lora the merged
        weights, and the adapter in `adapter/` inside it. Collective."""
        out_dir = Path(out_dir)
        state = self.weights.full_state_dict()
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.is_lora:
                lora.save_merged(self.weights.hf_module(), out_dir, state)
            else:
                self.weights.hf_module().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
        if self.is_lora:
            self.export_adapter(out_dir / lora.ADAPTER_DIR)
        barrier()
        return out_dir

    def save(self, ckpt_dir: str | Path) -> None:
        """DeepSpeed checkpoint (all ranks write their shards) + RNG per rank + HF export (under
        trainer.lora: the frozen base left out, and the adapter instead of the export). Collective."""
        ckpt_dir = Path(ckpt_dir)
        save_deepspeed_state(self.engine, ckpt_dir, self.rank, self.steps_done, frozen_base=self.is_lora)
        if self.is_lora:
            self.export_adapter(ckpt_dir / lora.ADAPTER_DIR)
        else:
            self.export_hf(ckpt_dir / "model")
        barrier()

    def load(self, ckpt_dir: str | Path) -> None:
        """The state `save` wrote; under trainer.lora only a checkpoint of this very adapter. Collective."""
        adapter = {k: v.shape for k, v in self.adapter_state()[1].items()} if self.is_lora else None
        self.steps_done = load_deepspeed_state(self.engine, ckpt_dir, self.rank, adapter)
