"""Will this recipe fit its GPUs? A per-GPU memory budget computed before launch.

Training side, per rank (N = trainer.nodes x trainer.nproc ranks):
  parameters   model dtype x P; ZeRO-3 divides by N and adds what it keeps gathered (up to
               DeepSpeed's stage3_max_live_parameters plus its prefetch bucket)
  gradients    model dtype x P; divided by N from ZeRO-2; 0 under ZeRO-Offload from ZeRO-2 (host memory)
  optimizer    AdamW m and v, plus DeepSpeed's fp32 master weights (except ZeRO-3 with an fp32
               model, which shares them): 8 or 12 bytes x P, divided by N from ZeRO-1, 0 when
               offloaded.
               The plain torch engine keeps m and v in the model dtype, no master copy.
  step peak    what exists only while a micro-batch trains, at the largest of its phases, and
               DeepSpeed's buffers beside them (step_memory.py).
  reserve      CUDA context and allocator fragmentation: 1 GiB + 5%, an assumption.
  colocated    (rollout.colocate) what the released SGLang servers keep on the GPU meanwhile
               (memory.py: SGLANG_OUTSIDE_POOL_GIB).

With C3PO++, a note gives the host memory and checkpoint size of the in-flight pool at its worst
(every rollout at full length), outside the GPU budgets (host_disk.c3po_pool_note).

Rollout side, per GPU of a server (tp GPUs each; SGLang sizes its static pool as
mem_fraction_static x GPU memory = weights + KV cache):
  weights      rollout dtype x P / tp
  KV cache     what is left of the pool; per token 2 (K, V) x layers x kv_heads x head_dim
               x dtype / tp. Sequences at full length (max_prompt_tokens + max_new_tokens)
               that fit at once, beside the concurrency the recipe asks of each server.

Colocated, a third budget is the GPU while the servers generate: their static pool (then
mem_fraction_static is a fraction of a GPU the offloaded trainer leaves almost empty), what SGLang
keeps outside it, and what the offloaded trainer still holds (memory.py); each node's host memory
holds its ranks' offloaded state (host_disk.py's footprint).

The model's dimensions come from model_dims.py. These are estimates for planning: `make bench`
prints them beside measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlrecipe.checks.host_disk import c3po_pool_note
from rlrecipe.checks.memory import (
    DS_MAX_LIVE_PARAMETERS,
    DS_PREFETCH_BUCKET,
    SGLANG_ADAPTER_SLOTS,
    SGLANG_OUTSIDE_POOL_GIB,
    SGLANG_OUTSIDE_POOL_NOTE,
    colocated,
    gradients_on_host,
    lora_params,
    rollout_phase_parts,
    stage_of,
)
from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims, kv_bytes, model_dims
from rlrecipe.checks.step_memory import beyond_previous, deepspeed_buffers, step_phases
from rlrecipe.recipe.schema import LoadedRecipe, Recipe


@dataclass
class Budget:
    """Bytes per GPU by component, and what the GPU holds."""

    side: str
    parts: dict[str, float]
    capacity: float  # what this side may use of one GPU
    notes: list[str]
    room_for_one_sequence: bool = True

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.room_for_one_sequence


def beside_training(recipe: Recipe, d: ModelDims, b: int, adapter: int | None) -> tuple[dict[str, float], list[str]]:
    """What shares a training GPU with the step: the KL reference model, and colocated, what the
    released SGLang servers keep."""
    parts: dict[str, float] = {}
    notes: list[str] = []
    p = d.params()
    if stage_of(recipe) == "rl" and recipe.rl.kl_coef > 0:
        if adapter is None:
            # train/reference.py: every rank holds the whole frozen copy, not a ZeRO part of it; its
            # no-grad forward runs between updates, inside the room the activations leave then
            parts["reference model"] = b * p
            notes.append(f"rl.kl_coef > 0: a whole reference model on every rank ({b * p / GIB:.1f} GiB)")
        else:
            notes.append("rl.kl_coef > 0: the reference is the trainer's base with the adapter off, no second model")
    if colocated(recipe):
        parts["SGLang while released"] = SGLANG_OUTSIDE_POOL_GIB * GIB
        notes.append(SGLANG_OUTSIDE_POOL_NOTE)
        if adapter is None:
            notes.append("colocated: the training phase, beside what the released SGLang servers keep")
        else:  # the servers release their KV cache only: their weights and adapters stay
            weights, slots = sglang_weights(recipe, d)
            parts["SGLang weights (kept)"] = weights
            parts["SGLang adapter slots (kept)"] = slots
            notes.append("colocated with LoRA: the training phase, beside the released SGLang servers, which keep "
                         "their weights and adapters (only the KV cache is released)")
    return parts, notes


def train_budget(recipe: Recipe, d: ModelDims, device: str = "cuda") -> Budget:
    tr, m = recipe.trainer, recipe.model
    p, b = d.params(), BYTES[m.dtype]
    act_b = 2 if (tr.bf16_autocast or b == 2) else 4
    deepspeed = tr.engine == "deepspeed"
    n = tr.nodes * tr.nproc if deepspeed else 1
    stage = tr.zero_stage if deepspeed else 0
    adapter = lora_params(recipe, d)
    trained = p if adapter is None else adapter
    notes = []
    if stage >= 3:
        # ZeRO-3 releases a gathered parameter only past stage3_max_live_parameters (or when it is
        # not reused within stage3_max_reuse_distance), and prefetches ahead of that
        gathered = b * min(p, DS_MAX_LIVE_PARAMETERS + DS_PREFETCH_BUCKET)
        params = gathered if tr.offload_params else b * p / n + gathered
        if tr.offload_params:
            notes.append("parameters offloaded to CPU memory")
    else:
        params = b * p
    # ZeRO-Offload from ZeRO-2 reduces the gradient partition into host memory (memory.gradients_on_host)
    grads_host = deepspeed and gradients_on_host(stage, tr.offload_optimizer)[0]
    grads = 0.0 if grads_host else b * trained / (n if stage >= 2 else 1)
    # fp32 master weights: ZeRO-1/2 always clone their partition into one; ZeRO-3 shares it when
    # the model is fp32 already (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py)
    opt_per_param = (12 if b == 2 or stage < 3 else 8) if deepspeed else 2 * b
    optimizer = 0.0 if (deepspeed and tr.offload_optimizer) else opt_per_param * trained / (n if stage >= 1 else 1)
    if deepspeed and tr.offload_optimizer:
        notes.append(f"optimizer state ({opt_per_param * trained / n / GIB:.1f} GiB per rank) and fp32 gradients "
                     + ("and the gradient partition " if grads_host else "") + "offloaded to CPU memory")
    if not m.gradient_checkpointing:
        notes.append("no gradient checkpointing: every layer keeps its activations")
    if adapter is None:
        parts = {"parameters": params, "gradients": grads, "optimizer": optimizer}
    else:
        # the base frozen in the model dtype; the adapter's 16-bit copy partitioned as the base is
        parts = {"base parameters (frozen)": params, "adapter parameters": b * adapter / (n if stage >= 3 else 1),
                 "adapter gradients": grads, "adapter optimizer": optimizer}
        notes.append(f"trainer.lora rank {tr.lora.rank}: {adapter / 1e6:.1f}M adapter parameters train "
                     f"({b * adapter / 2**20:.0f} MiB), the {p / 1e9:.2f}B base is frozen (no gradients, no "
                     "optimizer state); the embedding and the head get no weight gradients")
    parts.update(beyond_previous(step_phases(recipe, d, act_b, b, n, stage, device)))
    if deepspeed:
        parts.update(deepspeed_buffers(d, b, n, stage, device, adapter, tr.offload_optimizer, tr.lora.rank))
    beside, beside_notes = beside_training(recipe, d, b, adapter)
    parts.update(beside)
    notes += beside_notes
    gpu = tr.gpu_memory_gib * GIB
    parts["reserve"] = GIB + 0.05 * gpu
    return Budget("train", parts, gpu, notes)


def trainer_kept_bytes(recipe: Recipe, d: ModelDims) -> float:
    """Colocated under LoRA: what a trainer rank keeps on its GPU while the servers generate, its 16-bit
    weights (the frozen base and the adapter, ZeRO-3's partition of them; what ZeRO-3 gathered is freed);
    0 for full fine-tuning, which offloads them."""
    adapter = lora_params(recipe, d)
    if adapter is None:
        return 0.0
    tr = recipe.trainer
    b = BYTES[recipe.model.dtype]
    zero3 = tr.engine == "deepspeed" and tr.zero_stage >= 3
    n = tr.nproc * tr.nodes if zero3 else 1
    base = 0.0 if (zero3 and tr.offload_params) else b * d.params() / n
    return base + b * adapter / n


def rollout_phase_budget(recipe: Recipe, d: ModelDims, train: Budget) -> Budget:
    """Colocated: the whole GPU while the servers generate (see the module docstring)."""
    pool, _, _, _ = sglang_memory(recipe, d)
    parts = rollout_phase_parts(pool, trainer_kept_bytes(recipe, d))
    notes = ["colocated: the rollout phase, the trainer offloaded" if lora_params(recipe, d) is None else
             "colocated with LoRA: the rollout phase, the trainer's adapter optimizer offloaded, its weights kept"]
    notes.append(SGLANG_OUTSIDE_POOL_NOTE)
    if "reference model" in train.parts:  # the frozen copy is not offloaded
        parts["reference model"] = train.parts["reference model"]
    return Budget("rollout phase", parts, recipe.trainer.gpu_memory_gib * GIB, notes)


def rollout_engines(recipe: Recipe) -> int:
    """Rollout engines a step's rollouts are spread over: each SGLang server's dp replicas (servers
    launched, or rollout.urls), or the one in-process engine."""
    ro = recipe.rollout
    if ro.engine != "sglang":
        return 1
    return (len(ro.urls) or ro.sglang.num_servers) * ro.sglang.dp_size


def sglang_weights(recipe: Recipe, d: ModelDims) -> tuple[float, float]:
    """Bytes per GPU of one SGLang engine's weights, and of its adapter slots under trainer.lora
    (SGLANG_ADAPTER_SLOTS adapters in the served dtype; 0 without LoRA), both inside its static pool."""
    s, b = recipe.rollout.sglang, BYTES[recipe.rollout.dtype]
    adapter = lora_params(recipe, d)
    slots = 0.0 if adapter is None else SGLANG_ADAPTER_SLOTS * b * adapter / s.tp_size
    return b * d.params() / s.tp_size, slots


def sglang_memory(recipe: Recipe, d: ModelDims) -> tuple[float, float, float, float]:
    """Bytes per GPU of one SGLang engine: its static pool (mem_fraction_static x GPU), the
    weights' share, what is left for the KV cache (after the adapter slots under LoRA), and one
    token's K and V (all layers)."""
    s = recipe.rollout.sglang
    pool = s.mem_fraction_static * recipe.trainer.gpu_memory_gib * GIB
    weights, slots = sglang_weights(recipe, d)
    return pool, weights, max(0.0, pool - weights - slots), d.kv_bytes_per_token(kv_bytes(recipe.rollout)) / s.tp_size


def kv_cache_tokens(loaded: LoadedRecipe) -> int | None:
    """Tokens the KV cache of one of the recipe's SGLang engines holds (the rows it can decode at
    once hold this many tokens together); None for the in-process engine, sized per batch."""
    if loaded.recipe.rollout.engine != "sglang":
        return None
    _, _, kv, kv_token = sglang_memory(loaded.recipe, model_dims(loaded))
    return int(kv // kv_token)


def rollout_budget(recipe: Recipe, d: ModelDims, stage: str) -> Budget:
    """RL: the step's rollouts; SFT and evaluation: the benchmark samples (n per problem)."""
    ro, rl, ev = recipe.rollout, recipe.rl, recipe.eval
    gpu = recipe.trainer.gpu_memory_gib * GIB
    b = BYTES[ro.dtype]
    if stage == "rl":
        seq = recipe.data.max_prompt_tokens + ro.max_new_tokens
        wanted_total = rl.c3po.pool_capacity if rl.c3po.enabled else rl.prompts_per_step * rl.samples_per_prompt
    else:  # AIME: 30 problems a benchmark
        seq = recipe.data.max_prompt_tokens + ev.max_new_tokens
        wanted_total = ev.n_samples * (ev.max_problems or 30)
    notes = ["rollouts of an RL step" if stage == "rl" else "evaluation rollouts"]
    if ro.engine == "sglang":
        s = ro.sglang
        tp, engines = s.tp_size, rollout_engines(recipe)
        pool, weights, kv, kv_token = sglang_memory(recipe, d)
        wanted = math.ceil(wanted_total / engines)
        notes.append(f"SGLang pool {s.mem_fraction_static:.2f} x GPU; {engines} engines of tp {tp}")
    else:  # in-process engine: one process holds weights and the KV cache of its decoding slots
        weights = b * d.params()
        kv_token = d.kv_bytes_per_token(kv_bytes(ro))
        wanted = min(ro.max_batch, wanted_total)
        kv = wanted * seq * kv_token
        pool = weights + kv
    fit = int(kv // (seq * kv_token)) if kv_token else 0
    if ro.kv_storage != "auto":
        notes.append(f"KV cache {ro.kv_storage}: 1 byte an element")
    notes.append(f"{_count(fit, 'sequence')} of {seq} tokens fit at once beside the {wanted} asked of each engine"
                 + ("" if fit >= wanted else " (SGLang queues or retracts the rest: slower, not out of memory)"))
    if stage == "rl" and rl.c3po.enabled:
        notes.append(c3po_pool_note(rl.c3po.pool_capacity, recipe.data.max_prompt_tokens, ro.max_new_tokens))
    parts = {"weights": weights, "KV cache": kv}
    if ro.engine == "sglang" and lora_params(recipe, d) is not None:
        parts = {"weights": weights, "adapter slots": sglang_weights(recipe, d)[1], "KV cache": kv}
    return Budget("rollout", parts, pool if ro.engine == "sglang" else gpu, notes, room_for_one_sequence=fit >= 1)


def plan(loaded: LoadedRecipe) -> tuple[ModelDims, str, list[Budget]]:
    """The model's dimensions, the recipe's stage, and its budgets (no training side for evaluation)."""
    d = model_dims(loaded)
    stage = stage_of(loaded.recipe)
    budgets = [train_budget(loaded.recipe, d)] if stage != "eval" else []
    budgets.append(rollout_budget(loaded.recipe, d, stage))
    if colocated(loaded.recipe):
        budgets.append(rollout_phase_budget(loaded.recipe, d, budgets[0]))
    return d, stage, budgets


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
