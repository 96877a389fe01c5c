"""The colocated layout (rollout.colocate): what each GPU holds in each phase, and what the phase changes cost.

Trainer ranks and SGLang servers share every GPU and take turns. A step: the servers generate; they
release their weights and KV cache (/release_memory_occupation, SGLang under --enable-memory-saver);
the trainer reloads its offloaded state (DeepSpeed reload_states), computes the old log-probs and the
update, and offloads it again (offload_states, to pinned host memory); the servers take their weights
back, receive the new ones, flush the prefix cache and take the KV cache back; the weights are verified.

The new weights reach the resumed servers by one of three pushes that are built, whichever costs
least (fit writes it as rollout.sglang.weight_sync):
  tensor    rank 0 gathers the weights, pickles them by value (base64 in a JSON body, one copy per
            tensor-parallel rank of the server) and POSTs them to each server in turn
            (rollout/sglang/tensor_push.py): servers x tp x the weights' bytes, one after another
  disk      rank 0 writes an HF export once; the servers load it (/update_weights_from_disk, into the
            storage /resume_memory_occupation mapped back), one server per node first and then the
            node's others from the page cache (rollout/sglang/weights.py), as bench/projection/push.py
            costs a split layout's disk push
  ipc       every trainer rank gathers the full weights (ZeRO-3, module by module, inside its node),
            copies them bucket by bucket into a fresh buffer on its GPU and shares it by CUDA IPC handle;
            rank 0 posts each bucket's handles to the servers side by side (MAX_PARALLEL_LOADS at once),
            each server rank copying from the trainer rank on its own GPU, and copies every bucket into
            pinned host buffers kept from push to push for the verification (rollout/weights/
            handle_push.py, handles.HostMirror, rollout/sglang/tensor_push.py handle_session). Only where
            every server shares a machine with the rank it reads (allowed_pushes: recipe/schema.py's
            rule). Verified on CPU against the released SGLang; on one H100 the push's handles were
            shared, opened by a second process, copied and mirrored to host memory bit for bit
            (bench/gpu/ipc_push.py), but not end to end with SGLang on a GPU.

So per GPU the peak is the larger of two phases (docs/gpu.md, "The colocated layout"):
  rollout   SGLang's static pool (mem_fraction_static x GPU: weights and KV cache), what SGLang keeps
            outside it, and what the offloaded trainer still holds
  training  the trainer's budget (plan.train_budget), and what the released SGLang still holds
and each node's host memory holds its ranks' offloaded state. What SGLang and an offloaded rank keep,
and what offloading moves, are memory.py's (the plan counts them too).

Every constant below is an assumption unless its comment says MEASURED; each comment says how to
measure it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rlrecipe.checks.memory import SGLANG_OUTSIDE_POOL_GIB, TRAINER_OFFLOADED_GIB, offloaded_bytes
from rlrecipe.checks.model_dims import BYTES, ModelDims
from rlrecipe.checks.step_time import GPU, H100, STEP_OVERHEAD_S, Training
from rlrecipe.recipe.refusals import ipc_refusal
from rlrecipe.recipe.systems import MAX_PARALLEL_LOADS, SGLangServer


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
    # ASSUMPTION, not verified: the push as built (weight_sync: tensor), per byte of the weights and per
    # tensor-parallel rank, for real SGLang on a GPU node: 0.25 GB/s. Each byte is pickled, base64-encoded,
    # JSON-encoded, sent over HTTP, parsed, decoded, unpickled and copied, one step after another on the CPU;
    # the GPU speeds none of it. CPU_STANDIN_BY_VALUE_BYTES_S is the whole chain measured here through
    # `rlrecipe serve`; the serialization alone (no HTTP) measured about as slow, so a faster host and
    # SGLang's uvicorn are assumed to make it about 4x faster, no more. Measure: /update_weights_from_tensor's
    # wall time for one push in a run's log (rollout/weights/sync.py logs it), weights x tp_size / seconds.
    by_value_bytes_s: float = 0.25e9
    # ASSUMPTION: trainer rank 0 writing the HF export (ZeRO-3 parameters gathered, safetensors written by
    # one process), bench/projection/push.py's PushModel.export_write_bps, which says why the gather's copy
    # into fresh pageable memory (1.3-1.6 GB/s on the H100 VMs here) is not costed apart. Measure: the
    # trainer's export_hf seconds in a run's log at this size.
    export_bytes_s: float = 2e9
    # ASSUMPTION: one server's /update_weights_from_disk of an export in the page cache into its GPU:
    # step_time.GPU.weight_push_bytes_s, PushModel.load_bps. Measure: one load's wall time, export cached.
    disk_load_bytes_s: float = H100.weight_push_bytes_s
    # ASSUMPTION: one node's read of the shared file system (one 100 Gb/s link) and the file system's
    # aggregate over all readers: PushModel.node_read_bps and fs_read_bps. They bind only across nodes
    # (the bench's projection at 128 GPUs). Measure: `dd` of the export after dropping the page cache, on
    # one node and on every node at once.
    node_read_bytes_s: float = 12.5e9
    fs_read_bytes_s: float = 100e9
    # ASSUMPTION, not verified on a GPU: the part of the push by handle (weight_sync: ipc) that peers
    # measure (the ZeRO-3 gather inside a node, the bucketed copies into shared buffers and one round of
    # loads; the further rounds' requests and the verification's copy are below), from their published
    # figure of about 1.6 s for a 14B model (14.8e9 parameters, 29.6 GB in bf16) on 8 x H100 (SkyRL, 1 GB
    # buckets, its engines loading side by side): 18.5 GB/s.
    # MEASURED on one H100 here (bench/gpu/ipc_push_h100.json): the sharing, a second process opening
    # the handles and copying, for 7B's 15.2 GB in 30 buckets of 512 MB, took 0.07 s, so the figure is
    # the gather and the engine's loading, neither measured. Measure: the push's seconds in a run's log
    # with one server, less the verification copy.
    ipc_push_bytes_s: float = 29.6e9 / 1.6
    # ASSUMPTION: one round of /update_weights_from_tensor by handle (one bucket into up to
    # MAX_PARALLEL_LOADS servers, which rank 0 posts side by side: tensor_push.handle_session; a request
    # carries names and handles, not bytes, and each server copies on its own GPU), so a round is
    # assumed to cost one request: 10 ms. MEASURED parts: 5.5 ms a request (median of 228) for the
    # request alone, the released SGLang 0.5.23 on this 2-core CPU taking one-tensor buckets of the demo
    # model by shared-memory file name, one server; on one H100 a 512 MB bucket's handles opened in
    # about 1 ms and copied in 0.6 ms (bench/gpu/ipc_push_h100.json); SGLang's load_weights on a GPU and
    # 32 requests at once are not measured. Measure: the push's seconds in a run's log against rounds x
    # buckets.
    ipc_request_s: float = 0.01
    # MEASURED on one H100 here (a Firecracker VM, torch 2.11; bench/gpu/ipc_push_h100.json): rank 0's
    # copy of each pushed bucket into host memory, which the checksum verification reads, as built
    # (handles.HostMirror: pinned buffers kept from push to push, non_blocking copies, one synchronize
    # at the end): the push took 0.351 s with the copy and 0.073 s without (medians after the first push,
    # 15.23 GB), so the copy added 0.278 s, 54.8 GB/s; a device-to-host copy into pinned memory alone ran
    # at 55.0 GB/s (a bucket) and 55.1 GB/s (4 GiB). (The file's cpu_copy_bytes_s, 545 GB/s, times the
    # issuing of the asynchronous copies and the last wait; the copies run beside the next buckets, and
    # show in the receiver's copy time.) Pinned copies are DMA at the bus's rate; the VM is not
    # expected to slow them, which a bare-metal node has not confirmed. Measure: `python3
    # bench/gpu/ipc_push.py` on the cluster's node (push_s_median less push_without_cpu_copy_s_median).
    verify_copy_bytes_s: float = 55e9
    # MEASURED with it: the first push also allocates those pinned buffers (cudaHostAlloc of the whole
    # weights), once per run (per process: a resumed run allocates them again): 16.34 s for the first
    # push against the 0.351 s median, 15.99 s more for 15.23 GB, 0.95 GB/s. Spread over the run's
    # pushes (rl.steps) where the caller passes them (ipc_push_s's pushes_per_run; fit and the
    # projection do), else left out of a push's seconds. Measure: the first push's seconds in a run's log
    # against the second's.
    mirror_alloc_bytes_s: float = 0.95e9
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
# MEASURED here (CPU, `rlrecipe serve` as the server, commit 9fcf686): 271 MB by value in about 4.0 s
# (pickle, base64, HTTP, unpickle, copy), for comparison with PhaseCosts.by_value_bytes_s.
CPU_STANDIN_BY_VALUE_BYTES_S = 271e6 / 4.0
# rollout.sglang.weight_sync_bucket_mb's default: the most one request carries
DEFAULT_BUCKET_BYTES = SGLangServer.model_fields["weight_sync_bucket_mb"].default << 20
# The pushes built into SGLang servers that fit costs (rollout.sglang.weight_sync), cheapest chosen.
BUILT_PUSHES = ("tensor", "disk", "ipc")
# Under trainer.lora SGLang takes an adapter by value (/load_lora_adapter_from_tensors) or from a PEFT
# directory (/load_lora_adapter) only (rollout/weights/transport.py's for_lora)
LORA_PUSHES = ("tensor", "disk")


def allowed_pushes(*, colocated: bool, trainer_nodes: int = 1, rollout_nodes: int = 1,
                   server_gpus: int = 0, trainer_ranks: int = 0, lora: bool = False) -> tuple[str, ...]:
    """The built pushes a layout may use: "ipc" only where the recipe accepts it (refusals.ipc_refusal;
    attached rollout.urls must be local too, which the layout cannot say); under LoRA (`lora`) the
    adapter's two (LORA_PUSHES)."""
    if lora:
        return LORA_PUSHES
    if ipc_refusal(colocated=colocated, trainer_nodes=trainer_nodes, rollout_nodes=rollout_nodes,
                   server_gpus=server_gpus, trainer_ranks=trainer_ranks) is None:
        return BUILT_PUSHES
    return tuple(k for k in BUILT_PUSHES if k != "ipc")


def _weights(d: ModelDims, rollout_dtype: str, params: int | None = None) -> float:
    """Bytes of one push in the served dtype: the whole model, or `params` (the adapter under LoRA)."""
    return BYTES[rollout_dtype] * (d.params() if params is None else params)


def tensor_push_s(d: ModelDims, rollout_dtype: str, *, servers: int, tp: int, nodes: int = 1,
                  costs: PhaseCosts = ASSUMED, gpu: GPU = H100, params: int | None = None) -> float:
    """The push as built (weight_sync: tensor): every server's body holds the weights once per
    tensor-parallel rank, and the servers are posted one after another; across nodes rank 0's gather
    also crosses the network. Under LoRA (`params`: the adapter's) the same for the adapter, posted to
    /load_lora_adapter_from_tensors (rollout/sglang/lora.py: one pickle per tensor-parallel rank)."""
    w = _weights(d, rollout_dtype, params)
    return servers * tp * w / costs.by_value_bytes_s + (w / gpu.network_bytes_s if nodes > 1 else 0.0)


def disk_push_s(d: ModelDims, rollout_dtype: str, *, servers: int, nodes: int = 1,
                costs: PhaseCosts = ASSUMED, params: int | None = None) -> float:
    """weight_sync: disk: the export written once, then one server per node loads it from the shared file
    system (side by side, at most MAX_PARALLEL_LOADS at once, each at the least of its load rate, its
    node's link and its share of the file system), then the nodes' other servers from the page cache,
    MAX_PARALLEL_LOADS at a time (rollout/sglang/weights.py's order, recipe/systems.py's bound). Under
    LoRA (`params`) the adapter, a PEFT directory that /load_lora_adapter reads."""

    w = _weights(d, rollout_dtype, params)
    readers = min(servers, nodes)
    rate = min(costs.disk_load_bytes_s, costs.node_read_bytes_s,
               costs.fs_read_bytes_s / min(readers, MAX_PARALLEL_LOADS))
    seconds = w / costs.export_bytes_s + math.ceil(readers / MAX_PARALLEL_LOADS) * w / rate
    return seconds + math.ceil((servers - readers) / MAX_PARALLEL_LOADS) * w / costs.disk_load_bytes_s


def ipc_push_s(d: ModelDims, rollout_dtype: str, *, servers: int, nodes: int = 1,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES, costs: PhaseCosts = ASSUMED, gpu: GPU = H100,
               posted_at_once: int = MAX_PARALLEL_LOADS, pushes_per_run: int | None = None,
               params: int | None = None) -> float:
    """weight_sync: ipc, as built: the gather inside a node, the shared buckets and one round of loads
    (ipc_push_bytes_s); rank 0 posting each of the (at least) weights / bucket_bytes buckets to the
    servers `posted_at_once` at a time (MAX_PARALLEL_LOADS as built), ipc_request_s a further round;
    rank 0's copy of the weights into pinned host memory for the verification (verify_copy_bytes_s);
    across nodes each rank's gather also crosses the network; and, given `pushes_per_run` (the run's
    steps), the first push's allocation of the pinned buffers (mirror_alloc_bytes_s) spread over them."""
    w = _weights(d, rollout_dtype, params)
    buckets = math.ceil(w / bucket_bytes)
    rounds = math.ceil(servers / posted_at_once) - 1  # the first round is in ipc_push_bytes_s's figure
    once = w / costs.mirror_alloc_bytes_s / pushes_per_run if pushes_per_run else 0.0
    return (w / costs.ipc_push_bytes_s + rounds * buckets * costs.ipc_request_s + w / costs.verify_copy_bytes_s
            + (w / gpu.network_bytes_s if nodes > 1 else 0.0) + once)


def push_seconds(d: ModelDims, rollout_dtype: str, *, servers: int, tp: int, nodes: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, costs: PhaseCosts = ASSUMED,
                 gpu: GPU = H100, pushes_per_run: int | None = None, params: int | None = None) -> dict[str, float]:
    """Seconds of one push to `servers` servers of `tp` GPUs on `nodes` nodes, by each built way
    (`bucket_bytes`: rollout.sglang.weight_sync_bucket_mb; `pushes_per_run`: rl.steps, over which a
    push's one-time cost is spread, None to leave it out; `params`: what is pushed, the adapter's
    parameters under LoRA, None for the whole model)."""
    return {"tensor": tensor_push_s(d, rollout_dtype, servers=servers, tp=tp, nodes=nodes, costs=costs, gpu=gpu,
                                    params=params),
            "disk": disk_push_s(d, rollout_dtype, servers=servers, nodes=nodes, costs=costs, params=params),
            "ipc": ipc_push_s(d, rollout_dtype, servers=servers, nodes=nodes, bucket_bytes=bucket_bytes,
                              costs=costs, gpu=gpu, pushes_per_run=pushes_per_run, params=params)}


def cheapest_push(seconds: dict[str, float], allowed: tuple[str, ...] = BUILT_PUSHES) -> str:
    """The allowed push (allowed_pushes) that costs least (on a tie the first of BUILT_PUSHES: tensor,
    nothing written to disk)."""
    return min(allowed, key=lambda kind: seconds[kind])


def phase_seconds(d: ModelDims, *, dtype: str, ranks: int, offload_optimizer: bool, offload_params: bool,
                  push_s: float, zero_stage: int = 3, costs: PhaseCosts = ASSUMED,
                  adapter: int | None = None) -> dict[str, float]:
    """Seconds of each phase change of a colocated step (the training itself aside), with `push_s`, the
    push's seconds (push_seconds: it depends on the servers, which the training options do not). Under
    LoRA (`adapter`: its parameters) the weights stay on the GPU and the servers release and resume their
    KV cache only: release_s and resume_s are kept as assumed (per call, not per byte)."""
    moved = offloaded_bytes(d, dtype, ranks, offload_optimizer, offload_params, zero_stage,
                            adapter) / costs.offload_bytes_s
    return {"release": costs.release_s, "reload": moved, "offload": moved, "resume": costs.resume_s,
            "push": push_s, "verify": costs.verify_s}


def colocated_training(training: Training, phases: dict[str, float]) -> Training:
    """A training step on shared GPUs: the split layout's push (over disk or a broadcast, in
    "step and push") replaced by the phase changes, the colocated push among them."""
    parts = {k: v for k, v in training.parts.items() if k != "step and push"}
    parts["step"] = STEP_OVERHEAD_S
    parts.update(phases)
    return Training(sum(parts.values()), training.microbatches, parts)


def describe(costs: PhaseCosts = ASSUMED) -> dict[str, str]:
    """The assumptions, for a result's record."""
    out = {k: (f"{v / 1e9:g} GB/s" if k.endswith("bytes_s") else f"{v:g} s") for k, v in asdict(costs).items()}
    out.update(sglang_outside_pool=f"{SGLANG_OUTSIDE_POOL_GIB:g} GiB (unmeasured)", trainer_offloaded=f"{TRAINER_OFFLOADED_GIB:g} GiB",
               cpu_standin_by_value_measured=f"{CPU_STANDIN_BY_VALUE_BYTES_S / 1e9:.3g} GB/s",
               ipc_push_bytes_s=f"{costs.ipc_push_bytes_s / 1e9:g} GB/s (GPU-unverified)",
               verify_copy_bytes_s=f"{costs.verify_copy_bytes_s / 1e9:g} GB/s (measured into pinned memory, one H100)",
               mirror_alloc_bytes_s=f"{costs.mirror_alloc_bytes_s / 1e9:g} GB/s (measured, one H100; once a run)")
    return out
