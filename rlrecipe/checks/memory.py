"""Bytes that the memory plan (plan.py), the colocated layout (colocate.py) and the host and disk
footprint (host_disk.py) count, below all three: which stage a recipe is for and whether its servers
share the trainer's GPUs (what decides which parts count), DeepSpeed's buffer defaults, what a released
SGLang server and an offloaded trainer rank keep on a GPU, what a rank moves to host memory while the
servers generate, and what trains (the whole model, or under trainer.lora the adapter alone).

Every constant below is an assumption unless its comment says otherwise; each comment says how to
measure it.
"""

from __future__ import annotations

from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims
from rlrecipe.recipe.schema import Recipe

# DeepSpeed's defaults the engine leaves (train/deepspeed_setup.py sets none of these): elements
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000

# ASSUMPTION, NOT MEASURED HERE: SGLang's memory outside its static pool (the pool is the weights and
# KV cache, mem_fraction_static of the GPU): its token-to-KV index pools, CUDA graphs, activations,
# sampler and CUDA context, which stay while the trainer trains. What published logs show for a 7-8B
# model at tp 1 (docs/gpu.md, "SGLang outside its pool", quotes each line):
# - the index pools (req_to_token and the like), taken after the KV cache: 1.12 GB for
#   Llama-3.1-8B at mem_fraction_static 0.88 (SGLang docs, send_request notebook: "KV Cache is
#   allocated. K size: 27.13 GB, V size: 27.13 GB", "Memory pool end. avail mem=8.34 GB" after
#   "Load weight end ... avail mem=63.72 GB"), 1.18 GB in sgl-project/sglang PR #4760;
# - CUDA graphs: "mem usage=1.44 GB" capturing 52 batch sizes up to 512 (PR #11830, a model with
#   Qwen2-7B's KV size per token), 1.00-1.04 GB up to 256 (PR #12978, tp 2);
# - activations: not logged; SGLang's tuning guide (docs/advanced_features/hyperparameter_tuning.md)
#   says reserving 5-8 GB for activations is typically sufficient, and its own default reserves 13.1
#   GiB on an 80 GB GPU at tp 1 (server_args.py, _handle_gpu_memory_settings: 512 MiB + 1.5 MiB a
#   chunked-prefill token + 2 MiB a CUDA-graph batch size + tp/8 GiB, at least 10 GiB above 60 GB).
# The logged parts come to about 2.6 GB; with SGLang's 5-8 GB for activations, 7.6-10.6. This figure
# sits between: the plan's margins say how far above it each layout still fits (`fit`'s headers).
# Measure: nvidia-smi's figure for the server process minus the pool, after /release_memory_occupation
# and at the peak of a rollout.
SGLANG_OUTSIDE_POOL_GIB = 6.0
SGLANG_OUTSIDE_POOL_LOGGED_GIB = 2.6  # the index pools and CUDA graphs above, as logged
SGLANG_OUTSIDE_POOL_NOTE = (f"SGLang's {SGLANG_OUTSIDE_POOL_GIB:g} GiB outside its pool is an assumption, not measured "
                            f"(logged parts at 7-8B {SGLANG_OUTSIDE_POOL_LOGGED_GIB:g} GiB; SGLang's guide reserves 5-8 GB "
                            "more for activations; its default on an 80 GB GPU at tp 1 is 13.1 GiB: docs/gpu.md)")
# ASSUMPTION: what a trainer rank holds once everything is offloaded: its CUDA context and NCCL
# buffers (~1 GiB) and ZeRO-3's persistent small parameters (norms, biases: megabytes), the caching
# allocator emptied after offload_states. Measure: nvidia-smi's figure for a rank after offload_states
# and torch.cuda.empty_cache().
TRAINER_OFFLOADED_GIB = 1.5
# Under trainer.lora SGLang holds this many adapters at once (rollout/sglang/lora.py's
# MAX_LORAS_PER_BATCH: the old and the new side by side while one replaces the other), each at the
# adapter's size in the served dtype. ASSUMPTION: inside its static pool (allocated after the weights,
# before the KV cache is sized from what is left), and kept while the KV cache is released. Measure: the
# KV cache tokens a server logs at start with and without --enable-lora.
SGLANG_ADAPTER_SLOTS = 2


def stage_of(recipe: Recipe) -> str:
    """The stage a recipe is for: the one whose section it sets (rl or sft), else evaluation."""
    for stage in ("rl", "sft"):
        if stage in recipe.model_fields_set and recipe.data.train:
            return stage
    return "eval"


def colocated(recipe: Recipe) -> bool:
    """Rollout servers launched on the trainer's GPUs, taking turns with it."""
    return recipe.rollout.colocate and recipe.rollout.engine == "sglang" and stage_of(recipe) == "rl"


def lora_params(recipe: Recipe, d: ModelDims) -> int | None:
    """The adapter's parameters under trainer.lora (ModelDims.lora_params); None for full fine-tuning."""
    lora = recipe.trainer.lora
    return d.lora_params(lora.rank, lora.target_modules) if lora.enabled else None


def trained_params(recipe: Recipe, d: ModelDims) -> int:
    """Parameters with gradients and optimizer state, which each push sends: the adapter under
    trainer.lora, else the whole model."""
    adapter = lora_params(recipe, d)
    return d.params() if adapter is None else adapter


def gradients_on_host(zero_stage: int, offload_optimizer: bool) -> tuple[bool, bool]:
    """Whether ZeRO-Offload keeps a rank's 16-bit gradient partition and its fp32 gradient partition in
    host memory instead of on its GPU. The fp32 gradients are the CPU optimizer's at every stage
    (stage_1_and_2.py: single_partition_of_fp32_groups' grad on the CPU; stage3.py: the subgroups'
    gradient buffers on the CPU). ZeRO-2 copies each reduced gradient straight into them
    (copy_grads_in_partition) and ZeRO-3 accumulates its partition in grad_partitions_flat_buffer on
    the optimizer's device, the CPU; ZeRO-1 keeps the whole 16-bit gradients on the GPU until the
    accumulation boundary. DeepSpeed's own estimators count neither on the GPU under offload."""
    return offload_optimizer and zero_stage >= 2, offload_optimizer


def offloaded_bytes(d: ModelDims, dtype: str, ranks: int, offload_optimizer: bool, offload_params: bool,
                    zero_stage: int = 3, adapter: int | None = None) -> float:
    """Bytes a DeepSpeed rank moves to host memory and back each step (offload_states): its 16-bit
    parameters and gradients (partitioned from ZeRO-3 and ZeRO-2), its fp32 gradient partition, its
    optimizer state (fp32 master weights, m and v), less what ZeRO-Offload keeps on the host already
    (the optimizer state, the fp32 gradients, and from ZeRO-2 the 16-bit ones: `gradients_on_host`),
    and ZeRO-3's reduce bucket (its contiguous gradient buffer). What ZeRO-3 gathers for a forward is
    freed, not moved. Under LoRA (`adapter`: its parameters) the weights stay on the GPU (the frozen base
    and the adapter's 16-bit copy): only the adapter's gradients and optimizer state and the bucket move."""
    p, b = d.params(), BYTES[dtype]
    t = p if adapter is None else adapter
    params = 0.0 if (offload_params or adapter is not None) else b * p / (ranks if zero_stage >= 3 else 1)
    grads_host, fp32_host = gradients_on_host(zero_stage, offload_optimizer)
    grads = 0.0 if grads_host else b * t / (ranks if zero_stage >= 2 else 1)
    fp32_grads = 0.0 if fp32_host else 4.0 * t / ranks
    bucket = b * DS_REDUCE_BUCKET if zero_stage >= 3 else 0.0
    optimizer = 0.0 if offload_optimizer else 12.0 * t / ranks
    return params + grads + fp32_grads + bucket + optimizer


def trainer_offloaded_bytes(recipe: Recipe, d: ModelDims, adapter: int | None) -> float:
    """Bytes a colocated rank moves to host memory while the servers generate: DeepSpeed's
    offload_states (`offloaded_bytes`); the torch engine's weights, gradients and AdamW's m
    and v, all in the model dtype. `adapter`: the recipe's `lora_params`, derived by the caller."""
    tr = recipe.trainer
    if tr.engine != "deepspeed":  # under LoRA the adapter's gradients, m and v: the weights stay
        return (4.0 * d.params() if adapter is None else 3.0 * adapter) * BYTES[recipe.model.dtype]
    return offloaded_bytes(d, recipe.model.dtype, tr.nproc * tr.nodes, tr.offload_optimizer,
                           tr.offload_params, tr.zero_stage, adapter)


def rollout_phase_parts(pool: float, trainer_kept: float = 0.0) -> dict[str, float]:
    """Bytes per GPU while the servers generate: their pool, what they keep outside it, the offloaded
    trainer, and under LoRA the trainer's weights, which stay (`trainer_kept`)."""
    parts = {"SGLang static pool": pool, "SGLang outside its pool": SGLANG_OUTSIDE_POOL_GIB * GIB,
             "trainer while offloaded": TRAINER_OFFLOADED_GIB * GIB}
    if trainer_kept:
        parts["trainer's frozen base and adapter (kept)"] = trainer_kept
    return parts
