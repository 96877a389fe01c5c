"""What one micro-batch's training step needs on a rank beyond its persistent state (the parameters,
gradients and optimizer state that plan.py's `train_budget` counts), phase by phase, and DeepSpeed's
buffers beside them. The memory plan's training side adds these to its persistent parts.

The phases, in the order they run (a step accumulates over several micro-batches, so the gradients
are whole while the later ones run):
  activations      kept from forward to backward at trainer.max_tokens_per_microbatch = T: with
                   gradient checkpointing each decoder layer's input (T x hidden), without it every
                   layer's saved tensors, 10 hidden + 4 intermediate + 4 kv elements a token (a
                   SwiGLU decoder with RMSNorm; attention keeps O(T): flash or memory-efficient
                   kernels, one document at a time)
  log-probs        the head's backward (`train/logprobs.py`), the first thing backward runs: the
                   decoder's output and its response rows (2 x T x hidden), the last chunk's fp32
                   logits and the four [chunk x V] temporaries of the logsumexp and gather
                   gradients, and, while the earlier chunks run, the head's weight gradient held
                   between them (V x hidden)
  layer backward   one decoder layer's backward: with checkpointing its recomputed activations, and
                   the MLP's two [T x intermediate] gradients beyond what it frees
  embedding grad   the embedding's dense weight gradient (V x hidden), after the activations are
                   freed
  optimizer step   AdamW's temporaries, after backward: torch's foreach path (CUDA) one per
                   parameter, its per-tensor path (CPU) two of the largest tensor (the square root
                   and its quotient); DeepSpeed steps over its flat fp32 partition on the GPU, or,
                   with the optimizer offloaded, on the host (CPU Adam over the host's fp32
                   partition; the 16-bit weights come back through a host-side conversion), which
                   leaves the GPU nothing to hold
Each phase's line in the budget is what it needs beyond the ones before it, so the lines add up to
the largest phase. Under DeepSpeed the fp32 gradient copy and ZeRO-3's reduce bucket are added on
top (`deepspeed_buffers`); ZeRO-1/2's bucket lives in backward only, so it joins the backward
phases (`backward_bucket`).
"""

from __future__ import annotations

from rlrecipe.checks.memory import DS_REDUCE_BUCKET, gradients_on_host, lora_params
from rlrecipe.checks.model_dims import ModelDims
from rlrecipe.recipe.schema import Recipe


def activation_elements_per_token_layer(d: ModelDims) -> int:
    return 10 * d.hidden + 4 * d.intermediate + 4 * d.kv_dim


# The head's backward holds the last chunk's fp32 logits (saved by logsumexp) and four more
# [chunk x V] fp32 tensors at once: logsumexp's gradient (x - lse, its exp, the product) and the
# gather's scattered gradient, before they are summed (measured on CPU, `python -m bench.step_phases
# head`; the H100 figures agree with the plan that counts them, docs/gpu.md).
LOGIT_COPIES_AT_HEAD_BACKWARD = 5
# A SwiGLU MLP's backward makes the gradient of down_proj's input, then those of silu(gate) and
# up, before freeing the first and the saved tensors they replace: two [T x intermediate] beyond.
MLP_BACKWARD_GRADIENTS = 2


def logprob_bytes(d: ModelDims, tokens: int, chunk: int, act_bytes: int, weight_bytes: int,
                  head_trains: bool = True) -> float:
    """The head's backward at its peak, every token a response row: the decoder output and its
    response rows, then the larger of the last chunk's backward (run first) and an earlier chunk's
    beside the head's weight gradient already made by the ones after it (none when the head is
    frozen: `head_trains` False, under LoRA)."""
    rows = 2.0 * tokens * d.hidden * act_bytes
    last = min(chunk, tokens)
    peak = LOGIT_COPIES_AT_HEAD_BACKWARD * last * d.vocab * 4.0
    if tokens > last:
        earlier = min(chunk, tokens - last)
        head_grad = d.vocab * d.hidden * weight_bytes if head_trains else 0.0
        peak = max(peak, LOGIT_COPIES_AT_HEAD_BACKWARD * earlier * d.vocab * 4.0 + head_grad)
    return rows + peak


def step_phases(recipe: Recipe, d: ModelDims, act_b: int, b: int, n: int, stage: int,
                device: str) -> dict[str, float]:
    """Bytes beyond the persistent parts in each phase of a micro-batch's step, in the order they
    run (see the module docstring). `stage` is the ZeRO stage under DeepSpeed, 0 for the torch engine.
    Under LoRA the embedding and the head are frozen (no weight gradients), each adapted layer keeps its
    rank-wide intermediate for backward, and the optimizer steps over the adapter alone."""
    m, tr = recipe.model, recipe.trainer
    t = tr.max_tokens_per_microbatch
    adapter = lora_params(recipe, d)
    per_token = activation_elements_per_token_layer(d)
    if adapter is not None:  # x A, rank wide, for every adapted linear layer of the block
        per_token += _lora_intermediates(recipe, d)
    one_layer = per_token * act_b * t
    kept = d.layers * t * d.hidden * act_b if m.gradient_checkpointing else d.layers * one_layer
    recomputed = one_layer if m.gradient_checkpointing else 0.0
    trained = d.params() if adapter is None else adapter
    if stage and tr.offload_optimizer:
        optimizer_step = 0.0
    elif stage:
        optimizer_step = 4.0 * trained / n
    elif device == "cuda":
        optimizer_step = float(b * trained)
    elif adapter is None:
        optimizer_step = 2.0 * b * max(d.vocab * d.hidden, d.intermediate * d.hidden)
    else:  # the adapter's largest tensor: B of gate/up or A of down
        optimizer_step = 2.0 * b * tr.lora.rank * max(d.intermediate, d.hidden)
    bucket = backward_bucket(d, b, stage, device, adapter)
    embedding = float(b * d.vocab * d.hidden) if adapter is None else 0.0
    return {"activations": kept,
            "log-probs": kept + logprob_bytes(d, t, tr.logprob_chunk_tokens, act_b, b, head_trains=adapter is None)
                         + bucket["log-probs"],
            "layer backward": kept + recomputed + MLP_BACKWARD_GRADIENTS * t * d.intermediate * act_b
                              + bucket["layer backward"],
            "embedding grad": embedding + bucket["embedding grad"],
            "optimizer step": optimizer_step}


def _lora_intermediates(recipe: Recipe, d: ModelDims) -> int:
    """Elements a token keeps per block for the adapter's backward: x A (rank wide) per adapted layer."""
    lora = recipe.trainer.lora
    targets = d.linear_shapes() if lora.target_modules == "all-linear" else lora.target_modules
    return lora.rank * len(targets)


def beyond_previous(phases: dict[str, float]) -> dict[str, float]:
    """Each phase's bytes beyond the largest before it: the lines add up to the largest phase."""
    out, high = {}, 0.0
    for name, need in phases.items():
        out[name] = max(0.0, need - high)
        high = max(high, need)
    return out


def reduce_bucket_held(width: int, written: int, device: str) -> float:
    """Bytes of DeepSpeed's gradient reduce bucket that count once `written` gradient elements are
    in it: CUDA allocates the whole bucket at once; on CPU only the pages written are resident."""
    return width * float(DS_REDUCE_BUCKET if device == "cuda" else min(DS_REDUCE_BUCKET, written))


def backward_bucket(d: ModelDims, b: int, stage: int, device: str, adapter: int | None = None) -> dict[str, float]:
    """ZeRO-1/2's gradient reduce bucket in each backward phase. DeepSpeed allocates it as backward
    starts and frees it before the optimizer step (stage_1_and_2.py, `setup_buckets`); what it
    holds by each phase: nothing during the head's backward, all but the first layer's and the
    embedding's gradients at the first layer. Under LoRA (`adapter`: its parameters) only the
    adapter's gradients reach it (CUDA still allocates it whole)."""
    if stage not in (1, 2):
        return {"log-probs": 0.0, "layer backward": 0.0, "embedding grad": 0.0}
    width = 4 if stage == 1 else b  # ZeRO-1 reduces in fp32, ZeRO-2 in the model's dtype
    if adapter is None:
        before_embedding = d.params() - d.vocab * d.hidden
        at_first_layer = before_embedding - d.layer_params()
    else:
        before_embedding, at_first_layer = adapter, adapter - adapter // d.layers
    return {"log-probs": reduce_bucket_held(width, 0, device),
            "layer backward": reduce_bucket_held(width, at_first_layer, device),
            "embedding grad": reduce_bucket_held(width, before_embedding, device)}


def deepspeed_buffers(d: ModelDims, b: int, n: int, stage: int, device: str,
                      adapter: int | None = None, offload_optimizer: bool = False, lora_rank: int = 0) -> dict[str, float]:
    """DeepSpeed's own buffers, counted on top of the phases: the fp32 gradients of its partition
    (a 16-bit model; ZeRO-3 keeps that buffer whatever the dtype) and ZeRO-3's gradient reduce
    bucket, allocated once and kept (CUDA holds it whole; on CPU only the pages written count, at
    most the model). ZeRO-1/2's bucket lives in backward only (`backward_bucket`). Under LoRA the
    gradients are the adapter's (`adapter`: its parameters); ZeRO-3's bucket is still allocated
    whole on CUDA (stage3.py sizes it by reduce_bucket_size, which the engine leaves).
    Under ZeRO-Offload (`offload_optimizer`) the fp32 gradients live in host memory
    (memory.gradients_on_host), and ZeRO-1/2 keep instead one staging buffer on the GPU the size of the
    largest trained tensor in the model dtype (stage_1_and_2.py's temp_grad_buffer_for_gpu_offload): the
    embedding or the head, or under LoRA (`lora_rank`) an adapter matrix."""
    trained = d.params() if adapter is None else adapter
    out = {}
    if (b == 2 or stage >= 3) and not gradients_on_host(stage, offload_optimizer)[1]:
        out["fp32 gradient copy"] = 4.0 * trained / (n if stage >= 1 else 1)
    if offload_optimizer and stage in (1, 2):
        largest = (max(d.vocab, d.intermediate) * d.hidden if adapter is None
                   else lora_rank * max(d.intermediate, d.hidden))
        out["offload staging buffer"] = float(b * largest)
    if stage >= 3:
        out["reduce bucket"] = reduce_bucket_held(b, trained, device)
    return out
