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

Checkpoints: `save(dir)` writes DeepSpeed's own checkpoint (every rank writes its optimizer shard;
module, scheduler and `steps_done` from rank 0), each rank's RNG state, and a full HF export in
`dir/model` (the torch engine's layout). `load(dir)` restores all of that; it needs the same
number of ranks. `export_hf` gathers ZeRO-3 parameters layer by layer onto rank 0, which alone
writes; `rollout_state()` returns that gathered state dict on rank 0 (an empty dict elsewhere).

Loading: under ZeRO-3 the weights are partitioned as they load (`zero.Init`), so no rank ever
holds the whole model; under ZeRO-1/2 every rank holds a full copy anyway (only optimizer state
and gradients are sharded).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.packing import allocate_microbatches, balanced_bins
from rlrecipe.core.dist import barrier
from rlrecipe.core.errors import UserError
from rlrecipe.modeling import distinct_tensors, enable_checkpointing, load_model
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train import lora
from rlrecipe.train.base import LossFn, StepResult, TrainSample, add_sums
from rlrecipe.train.launch import init_distributed
from rlrecipe.train.torch_engine import (
    TorchTrainEngine,
    capture_rng,
    empty_device_cache,
    load_state,
    make_scheduler,
    restore_rng,
)
from rlrecipe.train.varlen_attention import training_attention

CKPT_SUBDIR = "deepspeed"
CKPT_TAG = "state"


def _skip_cpu_shm_comm_build() -> None:
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


class DeepSpeedTrainEngine(TorchTrainEngine):
    """Same interface as TorchTrainEngine; `_forward` and `microbatches` are inherited."""

    def __init__(self, model_dir: str | Path, cfg: TrainerSection, total_steps: int, dtype: str = "float32",
                 temperature: float = 1.0, gradient_checkpointing: bool = False,
                 ds_config_overrides: dict | None = None, attn_implementation: str = "sdpa",
                 colocated: bool = False):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        init_distributed()
        _skip_cpu_shm_comm_build()
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
        self.partitioned_load = False
        model = self._load_model(model_dir, dtype, training_attention(attn_implementation))
        if gradient_checkpointing:
            enable_checkpointing(model)
        if cfg.lora.enabled:  # the base frozen: only the adapter has gradients and optimizer state
            model = lora.wrap(model, cfg.lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # ZeRO-3 moves its optimizer's state off the GPU (offload_states, for a colocated rollout) only
        # with DeepSpeed's FusedAdam, a CUDA kernel of the same AdamW update
        self.fused_adam = colocated and self.zero3 and torch.cuda.is_available()
        if self.fused_adam:
            from deepspeed.ops.adam import FusedAdam

            with plain_cuda_arch_list():
                optimizer = FusedAdam(trainable, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                      eps=cfg.adam_eps, weight_decay=cfg.weight_decay, adam_w_mode=True)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                          eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config,
            lr_scheduler=lambda opt: make_scheduler(opt, cfg, total_steps))
        self.model = self.engine  # TorchTrainEngine._forward calls self.model(...)
        self.device = torch.device(get_accelerator().current_device_name())
        self.steps_done = 0
        self._pad_token = 0

    def _load_model(self, model_dir: str | Path, dtype: str, attn_implementation: str) -> torch.nn.Module:
        """ZeRO-3: each rank materialises only its partition while loading (zero.Init through
        transformers' DeepSpeed integration), so host memory holds one copy of the weights across
        ranks instead of one per rank. The integration is switched on for this load only: while it
        is on, every from_pretrained in the process (e.g. the rollout engine's) would be partitioned."""
        if not self.zero3:
            return load_model(model_dir, dtype, attn_implementation)
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        switch = HfDeepSpeedConfig(self.ds_config)  # transformers holds only a weak reference to it
        try:
            model = load_model(model_dir, dtype, attn_implementation)
        finally:
            del switch
        self.partitioned_load = all(hasattr(p, "ds_id") for p in model.parameters())
        return model

    # -- data parallel helpers -----------------------------------------------------------------
    def shard(self, samples: list[TrainSample]) -> list[int]:
        """Indices of the samples this rank handles: tokens balanced over ranks, data order kept."""
        if self.world == 1:
            return list(range(len(samples)))
        lengths = [len(s.input_ids) for s in samples]
        bins = balanced_bins(lengths, self.world, budget=sum(lengths) + 1) or [[] for _ in range(self.world)]
        return sorted(bins[self.rank])

    def _max_over_ranks(self, n: int) -> int:
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self.device)  # nccl reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return dict(values)
        gathered: list[dict[str, float]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, values)
        out: dict[str, float] = {}
        for part in gathered:
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def _dummy(self) -> list[TrainSample]:
        return [TrainSample([self._pad_token, self._pad_token], 1)]

    # -- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainSample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logp, entropy) per sample for its response tokens, on every rank (each computes its share)."""
        self.engine.eval()
        mine = self.shard(samples)
        bins = self.microbatches_of(samples, mine)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self._max_over_ranks(len(bins))):
            if i >= len(bins):
                self._forward(self._dummy(), with_entropy=False)  # keep ZeRO-3's gathers in step
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
        n = max(1, self._max_over_ranks(len(bins)))
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
                logp, _ = self._forward(self._dummy(), with_entropy=False)
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
        totals = self._sum_over_ranks({"loss": local_loss, **stats})
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
    def _gathered(self) -> Iterator[tuple[str, torch.Tensor, str | None]]:
        """ZeRO-3, every rank: each parameter and persistent buffer as (name, tensor, the name of the
        parameter it is tied to or None), gathered module by module. Collective: consume in step; a
        tensor is valid until the next item (the module's gathered copies are freed after it). Under
        trainer.lora: the base model's names, each wrapped layer's weight with the adapter merged."""
        import deepspeed

        first: dict[int, str] = {}

        def visit(mod: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, str | None]]:
            if lora.is_lora_layer(mod):  # base and adapter gathered together: the merge needs both
                with deepspeed.zero.GatheredParameters(list(mod.parameters()), modifier_rank=None):
                    yield from ((prefix + name, t, None) for name, t in lora.merged_layer(mod))
                return
            with deepspeed.zero.GatheredParameters(list(mod.parameters(recurse=False)), modifier_rank=None):
                for name, p in mod.named_parameters(recurse=False):
                    yield prefix + name, p.detach(), first.get(p.ds_id)
                    first.setdefault(p.ds_id, prefix + name)
                for name, buf in mod.named_buffers(recurse=False):
                    if name not in mod._non_persistent_buffers_set:
                        yield prefix + name, buf.detach(), None
            for name, child in mod.named_children():
                yield from visit(child, prefix + name + ".")

        yield from visit(self._hf_module(), "")

    def _hf_module(self) -> torch.nn.Module:
        """The model under its HF names (under trainer.lora, inside PEFT's wrapper)."""
        return self.engine.module.get_base_model() if self.is_lora else self.engine.module

    def _lora_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0, {} on other ranks. Collective.

        ZeRO-3: gathered module by module onto rank 0 and copied to CPU. ZeRO-1/2: the module's own
        tensors (views, as TorchTrainEngine.rollout_state returns)."""
        module = self.engine.module
        if not self.zero3:  # every rank holds the whole model: views, no copy (as the torch engine)
            if self.rank != 0:
                return {}
            return lora.merged_state(module) if self.is_lora else {k: v.detach() for k, v in module.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for key, t, tied_to in self._gathered():
            if self.rank == 0:  # tied weights stay tied
                out[key] = out[tied_to] if tied_to is not None else t.to("cpu", copy=True)
        return out

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout engine: on rank 0; an empty dict elsewhere. Collective."""
        return self.full_state_dict()

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the full weights, tied ones once. ZeRO-3 gathers module by module and yields
        copies on the device (the gathered tensors are freed when the module's turn ends)."""
        if not self.zero3:
            module = self.engine.module
            yield from distinct_tensors(lora.merged_state(module) if self.is_lora else
                                        {k: v.detach() for k, v in module.state_dict().items()})
            return
        yield from ((key, t.clone()) for key, t, tied_to in self._gathered() if tied_to is None)

    def adapter_off(self):
        return lora.base_without_adapter(self.engine.module)

    def adapter_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Under trainer.lora, every rank: the adapter's config and tensors (on the CPU). Collective
        under ZeRO-3 (the adapter is gathered: megabytes)."""
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(self._lora_params(), modifier_rank=None) if self.zero3 \
            else contextlib.nullcontext()
        with gather:
            tensors = {k: v.to("cpu", copy=True) for k, v in lora.adapter_tensors(self.engine.module).items()}
        return lora.adapter_config(self.engine.module), tensors

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
        state = self.full_state_dict()
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._hf_module().save_pretrained(out_dir, state_dict=state, safe_serialization=True)
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
        ds_dir = ckpt_dir / CKPT_SUBDIR
        ds_dir.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(ds_dir), tag=CKPT_TAG, client_state={"steps_done": self.steps_done},
                                    exclude_frozen_parameters=self.is_lora)
        torch.save(capture_rng(), ds_dir / f"rng_rank{self.rank:05d}.pt")
        if self.is_lora:
            self.export_adapter(ckpt_dir / lora.ADAPTER_DIR)
        else:
            self.export_hf(ckpt_dir / "model")
        barrier()

    def load(self, ckpt_dir: str | Path) -> None:
        ds_dir = Path(ckpt_dir) / CKPT_SUBDIR
        rng_file = ds_dir / f"rng_rank{self.rank:05d}.pt"
        if not rng_file.exists():
            raise UserError(f"{ckpt_dir}: no DeepSpeed state for rank {self.rank} (resume with the same "
                            "trainer.nproc * trainer.nodes and trainer.engine: deepspeed)")
        from rlrecipe.train.deepspeed_safe_load import use_weights_only_loading

        use_weights_only_loading(self.engine)  # a tampered file cannot run code while loading
        path, client = self.engine.load_checkpoint(str(ds_dir), tag=CKPT_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True,
                                                   load_module_strict=not self.is_lora)  # frozen base left out
        if path is None:
            raise UserError(f"{ds_dir}: DeepSpeed could not load the checkpoint")
        self.steps_done = int(client["steps_done"])
        restore_rng(load_state(rng_file))
