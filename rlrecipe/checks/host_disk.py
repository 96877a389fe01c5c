"""Outside the GPUs: a recipe's footprint, computed once from its model's dimensions, at worst (every
rollout at full length): the host memory rank 0 needs, one checkpoint, and the disk the run directory
reaches, as `rlrecipe plan` prints them, `rlrecipe doctor` (and a stage at start) checks them and
`rlrecipe fit` weighs a node's memory by; and the C3PO++ pool's note, which the plan prints."""

from __future__ import annotations

from dataclasses import dataclass

from rlrecipe.checks.memory import (
    colocated,
    gradients_on_host,
    lora_params,
    stage_of,
    trainer_offloaded_bytes,
)
from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims
from rlrecipe.recipe.schema import Recipe

# Host memory of a rollout held as a Trajectory (Python lists), bytes per token, measured with
# tracemalloc on 100k tokens (ids below 152,064, float log-probs, one version): a prompt token is
# one int in a list, a response token an id, a log-prob and a version.
LIST_BYTES_PER_PROMPT_TOKEN = 36
LIST_BYTES_PER_RESPONSE_TOKEN = 76


@dataclass(frozen=True)
class Sizes:
    """What the footprint's parts are made of, derived once from the recipe and its model's dimensions."""

    stage: str  # stage_of the recipe: "rl", "sft" or "eval"
    params: int  # the model's parameters
    adapter: int | None  # the LoRA adapter's parameters; None for full fine-tuning
    trained: int  # what has gradients and optimizer state, and what a push sends
    dtype_bytes: int  # of model.dtype
    rollouts: tuple[int, float, float] | None  # RL: the rollouts rank 0 holds, as lists and as arrays
    colocated: bool  # the servers take turns with the trainer on its GPUs
    offloaded: float  # colocated: what a trainer rank moves to host memory meanwhile; else 0


@dataclass(frozen=True)
class Footprint:
    """A recipe's footprint outside the GPUs, bytes by part (see the module docstring)."""

    sizes: Sizes
    host: dict[str, float]  # rank 0's host memory beyond the Python process itself
    checkpoint: dict[str, float]  # one checkpoint on disk
    disk: dict[str, float]  # the run directory at its peak; empty for evaluation


def footprint(recipe: Recipe, d: ModelDims) -> Footprint:
    """The recipe's host memory, checkpoint and disk, from sizes derived once."""
    p = d.params()
    stage, together, adapter = stage_of(recipe), colocated(recipe), lora_params(recipe, d)
    offloaded = trainer_offloaded_bytes(recipe, d, adapter) if together else 0.0
    s = Sizes(stage=stage, params=p, adapter=adapter, trained=p if adapter is None else adapter,
              dtype_bytes=BYTES[recipe.model.dtype], rollouts=_rollouts(recipe) if stage == "rl" else None,
              colocated=together, offloaded=offloaded)
    checkpoint = _checkpoint_parts(recipe, s)
    return Footprint(s, _host_parts(recipe, s), checkpoint, _disk_parts(recipe, s, checkpoint))


def rollout_record_bytes(n: int, max_prompt_tokens: int, max_new_tokens: int) -> tuple[float, float]:
    """n rollouts at full length: as Trajectory lists in memory, and as the arrays a batch or a
    checkpoint holds them in (trajectory_arrays.py)."""
    from rlrecipe.trajectory.arrays import TOKEN_FIELDS

    size = {name: dtype.itemsize for name, dtype in TOKEN_FIELDS.items()}
    per_response = size["response_ids"] + size["logp_infer"] + size["versions"]
    held = n * (max_prompt_tokens * LIST_BYTES_PER_PROMPT_TOKEN + max_new_tokens * LIST_BYTES_PER_RESPONSE_TOKEN)
    arrays = n * (max_prompt_tokens * size["prompt_ids"] + max_new_tokens * per_response)
    return held, arrays


def c3po_pool_note(pool_capacity: int, max_prompt_tokens: int, max_new_tokens: int) -> str:
    """What C3PO++'s in-flight rollouts can take outside the GPUs, at most (every one at full length):
    the RL driver holds them between steps, and each checkpoint saves them as arrays."""
    held, saved = rollout_record_bytes(pool_capacity, max_prompt_tokens, max_new_tokens)
    return (f"C3PO++ pool: up to {pool_capacity} rollouts in flight, held by the RL driver between steps "
            f"(at most {held / GIB:.1f} GiB of host memory) and saved in each checkpoint (at most {saved / GIB:.1f} GiB)")


def _rollouts(recipe: Recipe) -> tuple[int, float, float]:
    """The rollouts rank 0 holds at once (C3PO++'s pool, else a step's), and their bytes as lists and
    as arrays (`rollout_record_bytes`)."""
    rl = recipe.rl
    n = rl.c3po.pool_capacity if rl.c3po.enabled else rl.prompts_per_step * rl.samples_per_prompt
    return n, *rollout_record_bytes(n, recipe.data.max_prompt_tokens, recipe.rollout.max_new_tokens)


def _host_parts(recipe: Recipe, s: Sizes) -> dict[str, float]:
    """Bytes of host memory rank 0 needs beyond the Python process itself, at worst (every rollout at
    full length): the rollouts it holds, the arrays a step's batch and a checkpoint's pool are
    packed into, the full weights gathered to its CPU for each push or export, and the push by
    handle's copy of them, kept from push to push. Under LoRA the optimizer and what a colocated rank
    offloads are the adapter's; the weights are still gathered whole for the final (merged) export."""
    ro, rl = recipe.rollout, recipe.rl
    b, adapter = s.dtype_bytes, s.adapter
    parts: dict[str, float] = {}
    if s.rollouts is not None:
        n, held, arrays = s.rollouts
        parts["rollouts held (lists)"] = held
        if rl.c3po.enabled:
            per_token = arrays / max(1, n * (recipe.data.max_prompt_tokens + ro.max_new_tokens))
            parts["step batch (arrays)"] = min(arrays, rl.c3po.token_budget * per_token * 1.1)
            parts["pool saved in a checkpoint (arrays)"] = arrays
        else:
            parts["step batch (arrays)"] = arrays
    if recipe.trainer.engine == "deepspeed" and recipe.trainer.zero_stage >= 3:
        # the merged export is float32 (train/lora.py save_merged)
        parts["weights gathered for push and export" if adapter is None else
              "weights gathered for the merged export"] = (b if adapter is None else 4) * s.params
    if s.stage == "rl" and ro.engine == "sglang" and ro.sglang.weight_sync == "ipc" and adapter is None:
        # the push by handle's copy of what it pushed, which the verification reads, kept from push to
        # push (pinned on a GPU: rollout/weights/handles.py's HostMirror), beside a checkpoint's export
        parts["push by handle's copy (kept, pinned)"] = b * s.params
    if recipe.trainer.engine == "deepspeed" and recipe.trainer.offload_optimizer:
        # ZeRO-Offload, a node's ranks' partitions: the fp32 master weights, Adam's m and v (12 bytes a
        # parameter) and the fp32 gradients (4), the 16 bytes DeepSpeed's estimators count on the host
        # (their 1.5 buffer factor aside); from ZeRO-2 also the 16-bit gradient partition, held on the host
        # instead of the GPU (stage3.py's grad_partitions_flat_buffer; stage_1_and_2.py's
        # accumulated_grads_in_cpu across micro-batches): memory.gradients_on_host
        per_node = s.trained / max(1, recipe.trainer.nodes)
        parts["optimizer and fp32 gradients offloaded"] = 16 * per_node
        if gradients_on_host(recipe.trainer.zero_stage, True)[0]:
            parts["gradient partition offloaded"] = b * per_node
    if s.colocated:
        # pinned: what the node's ranks offload while the servers generate
        parts["trainer state offloaded (pinned)"] = recipe.trainer.nproc * s.offloaded
    return parts


def _checkpoint_parts(recipe: Recipe, s: Sizes) -> dict[str, float]:
    """One checkpoint on disk, by part: the trainer's state (DeepSpeed: fp32 master weights and Adam's
    m and v, every rank's shard; the torch engine: m and v in the model dtype), an HF export of the
    weights, and C3PO++'s pool. Under LoRA the trainer's state is the adapter's and the adapter (PEFT's
    directory) replaces the export: the frozen base is never saved."""
    p, b, adapter = s.params, s.dtype_bytes, s.adapter
    state = 12 * s.trained if recipe.trainer.engine == "deepspeed" else 2 * b * s.trained
    if adapter is None:
        parts = {"trainer state": float(state), "weights (HF export)": float(b * p)}
    else:
        parts = {"trainer state (the adapter's)": float(state), "adapter (PEFT)": float(b * adapter)}
    if s.rollouts is not None and recipe.rl.c3po.enabled:  # the pool's rollouts, as arrays
        parts["C3PO++ pool"] = s.rollouts[2]
    return parts


def _disk_parts(recipe: Recipe, s: Sizes, checkpoint: dict[str, float]) -> dict[str, float]:
    """Bytes the run directory reaches at its peak: run.keep_checkpoints checkpoints kept plus one
    being written, the final export and, with disk weight sync, the export the servers load."""
    if s.stage == "eval":
        return {}
    b, adapter = s.dtype_bytes, s.adapter
    one = sum(checkpoint.values())
    parts = {f"checkpoints ({recipe.run.keep_checkpoints} kept + 1 being written)": (recipe.run.keep_checkpoints + 1) * one,
             "final export": float(b * s.params)}
    if adapter is not None:  # final/ holds the merged model, in float32 (train/lora.py), and the adapter beside it
        parts["final export"] = float(4 * s.params + b * adapter)
    if s.stage == "rl" and recipe.rollout.engine == "sglang" and recipe.rollout.sglang.weight_sync == "disk":
        # asynchronous, lag >= 2: each version waits in an export of its own until the rollout side
        # loads it (rollout_schedule.py), at most `lag` of them beside the synchronous one
        lag = recipe.rl.async_lag
        copies = 1 + (lag if lag >= 2 else 0)
        pushed = "export for the rollout servers" if adapter is None else "adapter for the rollout servers"
        parts[pushed + (f" ({copies} copies)" if copies > 1 else "")] = copies * float(b * s.trained)
    return parts
