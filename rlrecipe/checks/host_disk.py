"""Outside the GPUs: the host memory rank 0 needs and the disk the run directory reaches, at worst
(every rollout at full length), as `rlrecipe plan` prints them and `rlrecipe doctor` checks them."""

from __future__ import annotations

from rlrecipe.checks.memory import gradients_on_host, lora_params, trained_params
from rlrecipe.checks.model_dims import BYTES, ModelDims
from rlrecipe.checks.plan import colocated, rollout_record_bytes, stage_of, trainer_offloaded_bytes
from rlrecipe.recipe.schema import Recipe


def rank0_host_parts(recipe: Recipe, d: ModelDims) -> dict[str, float]:
    """Bytes of host memory rank 0 needs beyond the Python process itself, at worst (every rollout at
    full length): the rollouts it holds, the arrays a step's batch and a checkpoint's pool are
    packed into, the full weights gathered to its CPU for each push or export, and the push by
    handle's copy of them, kept from push to push. Under LoRA the optimizer and what a colocated rank
    offloads are the adapter's; the weights are still gathered whole for the final (merged) export."""
    ro, rl = recipe.rollout, recipe.rl
    b = BYTES[recipe.model.dtype]
    adapter = lora_params(recipe, d)
    parts: dict[str, float] = {}
    if stage_of(recipe) == "rl":
        n = rl.c3po.pool_capacity if rl.c3po.enabled else rl.prompts_per_step * rl.samples_per_prompt
        held, arrays = rollout_record_bytes(n, recipe.data.max_prompt_tokens, ro.max_new_tokens)
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
              "weights gathered for the merged export"] = (b if adapter is None else 4) * d.params()
    if stage_of(recipe) == "rl" and ro.engine == "sglang" and ro.sglang.weight_sync == "ipc" and adapter is None:
        # the push by handle's copy of what it pushed, which the verification reads, kept from push to
        # push (pinned on a GPU: rollout/weights/handles.py's HostMirror), beside a checkpoint's export
        parts["push by handle's copy (kept, pinned)"] = b * d.params()
    if recipe.trainer.engine == "deepspeed" and recipe.trainer.offload_optimizer:
        # ZeRO-Offload, a node's ranks' partitions: the fp32 master weights, Adam's m and v (12 bytes a
        # parameter) and the fp32 gradients (4), the 16 bytes DeepSpeed's estimators count on the host
        # (their 1.5 buffer factor aside); from ZeRO-2 also the 16-bit gradient partition, held on the host
        # instead of the GPU (stage3.py's grad_partitions_flat_buffer; stage_1_and_2.py's
        # accumulated_grads_in_cpu across micro-batches): memory.gradients_on_host
        per_node = trained_params(recipe, d) / max(1, recipe.trainer.nodes)
        parts["optimizer and fp32 gradients offloaded"] = 16 * per_node
        if gradients_on_host(recipe.trainer.zero_stage, True)[0]:
            parts["gradient partition offloaded"] = b * per_node
    if colocated(recipe):
        # pinned: what the node's ranks offload while the servers generate
        parts["trainer state offloaded (pinned)"] = recipe.trainer.nproc * trainer_offloaded_bytes(recipe, d)
    return parts


def checkpoint_bytes(recipe: Recipe, d: ModelDims) -> dict[str, float]:
    """One checkpoint on disk, by part: the trainer's state (DeepSpeed: fp32 master weights and Adam's
    m and v, every rank's shard; the torch engine: m and v in the model dtype), an HF export of the
    weights, and C3PO++'s pool. Under LoRA the trainer's state is the adapter's and the adapter (PEFT's
    directory) replaces the export: the frozen base is never saved."""
    p, b = d.params(), BYTES[recipe.model.dtype]
    adapter = lora_params(recipe, d)
    trained = p if adapter is None else adapter
    state = 12 * trained if recipe.trainer.engine == "deepspeed" else 2 * b * trained
    if adapter is None:
        parts = {"trainer state": float(state), "weights (HF export)": float(b * p)}
    else:
        parts = {"trainer state (the adapter's)": float(state), "adapter (PEFT)": float(b * adapter)}
    rl = recipe.rl
    if stage_of(recipe) == "rl" and rl.c3po.enabled:
        parts["C3PO++ pool"] = rollout_record_bytes(rl.c3po.pool_capacity, recipe.data.max_prompt_tokens,
                                                    recipe.rollout.max_new_tokens)[1]
    return parts


def disk_parts(recipe: Recipe, d: ModelDims) -> dict[str, float]:
    """Bytes the run directory reaches at its peak: run.keep_checkpoints checkpoints kept plus one
    being written, the final export and, with disk weight sync, the export the servers load."""
    stage = stage_of(recipe)
    if stage == "eval":
        return {}
    b = BYTES[recipe.model.dtype]
    adapter = lora_params(recipe, d)
    one = sum(checkpoint_bytes(recipe, d).values())
    parts = {f"checkpoints ({recipe.run.keep_checkpoints} kept + 1 being written)": (recipe.run.keep_checkpoints + 1) * one,
             "final export": float(b * d.params())}
    if adapter is not None:  # final/ holds the merged model, in float32 (train/lora.py), and the adapter beside it
        parts["final export"] = float(4 * d.params() + b * adapter)
    if stage == "rl" and recipe.rollout.engine == "sglang" and recipe.rollout.sglang.weight_sync == "disk":
        # asynchronous, lag >= 2: each version waits in an export of its own until the rollout side
        # loads it (rollout_schedule.py), at most `lag` of them beside the synchronous one
        lag = recipe.rl.async_lag
        copies = 1 + (lag if lag >= 2 else 0)
        pushed = "export for the rollout servers" if adapter is None else "adapter for the rollout servers"
        parts[pushed + (f" ({copies} copies)" if copies > 1 else "")] = copies * float(b * trained_params(recipe, d))
    return parts
