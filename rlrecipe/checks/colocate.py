"""The colocated layout (rollout.colocate): what each GPU holds in each phase, and what the phase changes cost.

Trainer ranks and SGLang servers share every GPU and take turns. A step: the servers generate; they
release their weights and KV cache (/release_memory_occupation, SGLang under --enable-memory-saver);
the trainer reloads its offloaded state (DeepSpeed reload_states), computes the old log-probs and the
update, and offloads it again (offload_states, to pinned host memory); the servers take their weights
back, receive the new ones in place (/update_weights_from_tensor over CUDA IPC, bucketed), flush the
prefix cache and take the KV cache back; the weights are verified.

So per GPU the peak is the larger of two phases (docs/gpu.md, "The colocated layout"):
  rollout   SGLang's static pool (mem_fraction_static x GPU: weights and KV cache), what SGLang keeps
            outside it, and what the offloaded trainer still holds
  training  the trainer's budget (plan.train_budget), and what the released SGLang still holds
and each node's host memory holds its ranks' offloaded state.

Every constant below is an assumption, not a measurement; each comment says how to measure it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims
from rlrecipe.checks.step_time import GPU, H100, Training

# ASSUMPTION: SGLang's activations, CUDA graphs, sampler and CUDA context, outside its static pool
# (SGLang's own default leaves 10-20% of a GPU). --enable-memory-saver releases only the pool (weights
# and KV cache), so this much stays while the trainer trains. Measure: nvidia-smi's figure for the
# server process after /release_memory_occupation.
SGLANG_OUTSIDE_POOL_GIB = 6.0
# ASSUMPTION: what a trainer rank holds once everything is offloaded: its CUDA context and NCCL
# buffers (~1 GiB) and ZeRO-3's persistent small parameters (norms, biases: megabytes), the caching
# allocator emptied after offload_states. Measure: nvidia-smi's figure for a rank after offload_states
# and torch.cuda.empty_cache().
TRAINER_OFFLOADED_GIB = 1.5


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of the phase changes of a colocated step, each an assumption (the comments: how to measure)."""

    # ASSUMPTION: /release_memory_occupation (weights and KV cache unmapped by torch_memory_saver).
    # Measure: the call's wall time in a run's log, at the recipe's size.
    release_s: float = 1.0
    # ASSUMPTION: /resume_memory_occupation for the weights and then the KV cache, with the prefix cache
    # flushed (pages mapped again, nothing copied). Measure: both calls' wall time in a run's log.
    resume_s: float = 1.0
    # ASSUMPTION: pinned host <-> GPU copies of offload_states / reload_states, per GPU, each direction:
    # 20 GB/s, step_time.GPU.pcie_bytes_s (PCIe Gen5 x16 is 64 GB/s nominal; GPUs behind one switch and
    # one host's memory share it). Measure: reload_states and offload_states of one rank, bytes over seconds.
    offload_bytes_s: float = H100.pcie_bytes_s
    # ASSUMPTION, not verified here: bucketed CUDA IPC in place (/update_weights_from_tensor), the ZeRO-3
    # gather inside one node included, from peers' published figure of about 1.6 s for a 14B model
    # (14.8e9 parameters, 29.6 GB in bf16) on 8 x H100: 18.5 GB/s. Measure: the push's wall time in a
    # run's log (rollout/weights/sync.py logs it).
    push_bytes_s: float = 29.6e9 / 1.6
    # ASSUMPTION: the weight verification after each push (checksums on both sides: the weights read once
    # at HBM speed, milliseconds, plus the calls). Measure: the verification's seconds in a run's log.
    verify_s: float = 0.5

    def scaled(self, **factors: float) -> PhaseCosts:
        """These costs with some made slower (factor > 1) or faster: a bandwidth is divided, a time multiplied."""
        values = asdict(self)
        for name, f in factors.items():
            values[name] = values[name] / f if name.endswith("bytes_s") else values[name] * f
        return PhaseCosts(**values)


ASSUMED = PhaseCosts()
PHASES = ("release", "reload", "train", "offload", "resume", "push", "verify")


def offloaded_bytes(d: ModelDims, dtype: str, ranks: int, offload_optimizer: bool, offload_params: bool,
                    zero_stage: int = 3) -> float:
    """Bytes a DeepSpeed rank moves to host memory and back each step (offload_states): its 16-bit
    parameters and gradients (partitioned from ZeRO-3 and ZeRO-2), its fp32 gradient partition, its
    optimizer state (fp32 master weights, m and v) unless ZeRO-Offload keeps that on the host already,
    and ZeRO-3's reduce bucket (its contiguous gradient buffer). What ZeRO-3 gathers for a forward is
    freed, not moved."""
    from rlrecipe.checks.plan import DS_REDUCE_BUCKET

    p, b = d.params(), BYTES[dtype]
    params = 0.0 if offload_params else b * p / (ranks if zero_stage >= 3 else 1)
    grads = b * p / (ranks if zero_stage >= 2 else 1)
    bucket = b * DS_REDUCE_BUCKET if zero_stage >= 3 else 0.0
    optimizer = 0.0 if offload_optimizer else 12.0 * p / ranks
    return params + grads + 4.0 * p / ranks + bucket + optimizer


def push_s(d: ModelDims, rollout_dtype: str, nodes: int, costs: PhaseCosts = ASSUMED, gpu: GPU = H100) -> float:
    """The push in place: the whole weights to every server at push_bytes_s (the gather within a node
    included); across nodes each rank's gather also crosses the network."""
    w = BYTES[rollout_dtype] * d.params()
    return w / costs.push_bytes_s + (w / gpu.network_bytes_s if nodes > 1 else 0.0)


def phase_seconds(d: ModelDims, *, dtype: str, rollout_dtype: str, ranks: int, nodes: int, offload_optimizer: bool,
                  offload_params: bool, zero_stage: int = 3, costs: PhaseCosts = ASSUMED,
                  gpu: GPU = H100) -> dict[str, float]:
    """Seconds of each phase change of a colocated step (the training itself aside)."""
    moved = offloaded_bytes(d, dtype, ranks, offload_optimizer, offload_params, zero_stage) / costs.offload_bytes_s
    return {"release": costs.release_s, "reload": moved, "offload": moved, "resume": costs.resume_s,
            "push": push_s(d, rollout_dtype, nodes, costs, gpu), "verify": costs.verify_s}


def colocated_training(training: Training, phases: dict[str, float]) -> Training:
    """A training step on shared GPUs: the split layout's push (over disk or a broadcast, in
    "step and push") replaced by the phase changes, the push in place among them."""
    from rlrecipe.checks.step_time import STEP_OVERHEAD_S

    parts = {k: v for k, v in training.parts.items() if k != "step and push"}
    parts["step"] = STEP_OVERHEAD_S
    parts.update(phases)
    return Training(sum(parts.values()), training.microbatches, parts)


def rollout_phase_parts(pool: float) -> dict[str, float]:
    """Bytes per GPU while the servers generate: their pool, what they keep outside it, the offloaded trainer."""
    return {"SGLang static pool": pool, "SGLang outside its pool": SGLANG_OUTSIDE_POOL_GIB * GIB,
            "trainer while offloaded": TRAINER_OFFLOADED_GIB * GIB}


def describe(costs: PhaseCosts = ASSUMED) -> dict[str, str]:
    """The assumptions, for a result's record."""
    out = {k: (f"{v / 1e9:g} GB/s" if k.endswith("bytes_s") else f"{v:g} s") for k, v in asdict(costs).items()}
    out.update(sglang_outside_pool=f"{SGLANG_OUTSIDE_POOL_GIB:g} GiB", trainer_offloaded=f"{TRAINER_OFFLOADED_GIB:g} GiB")
    return out
