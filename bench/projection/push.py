"""What one weight push costs at a recipe's size: seconds on each side, and bytes on the shared file system.

Two transports (`rollout.sglang.weight_sync`, rlrecipe/rollout/weights/transport.py):

- **disk** (the shipped default; forced at `rl.async_lag` >= 2, where the worker installs a copy held
  for later, rlrecipe/rl/schedule.py): trainer rank 0 writes an HF export of the weights to the run
  directory on the shared file system, then every rollout server loads it. Since
  rlrecipe/rollout/sglang/weights.py loads node by node (one server of each node first, then the node's
  other servers, which find the files in the page cache the first one filled), the shared file system
  serves **one read per node per push**, not one per server.
- **broadcast** (`weight_sync: distributed`): the trainer's tensors go over NCCL to every server at
  once; nothing is written; it cannot hold a copy for later, so it is not offered at lag >= 2.

Every constant is named with its source. Those marked ASSUMPTION are not measured here: measure
them on the cluster (the comments say how) and pass them in (`PushModel(...)`, `--push-*` flags of
bench.projection.asynchronous).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rlrecipe.recipe.systems import MAX_PARALLEL_LOADS

# bf16 weights of DeepSeek-R1-Distill-Qwen-7B: 7.62e9 parameters (its config.json, the Qwen2.5-Math-7B
# architecture: 28 layers, hidden 3584, intermediate 18944, vocabulary 152,064, untied embeddings) x 2 bytes
WEIGHT_BYTES_7B = 15.2e9
GPUS_PER_NODE = 8  # the recipes' nodes: 8 H100 each (recipes/7b_boba*.yaml headers)
# MEASURED on one H100 VM (Firecracker, torch 2.11): a device-to-host copy into fresh pageable memory, as the
# export's gather makes: 1.29 GB/s inside an earlier push by handle (commit f263fee), 1.54-1.61 GB/s alone
# (bench/gpu/ipc_push_h100.json, d2h_fresh_pageable_bytes_s); the slowest, 1.3 GB/s. Not used by PushModel
# (export_write_bps says why); the colocated projection's sensitivity row uses it.
FRESH_PAGEABLE_BYTES_S = 1.3e9


@dataclass(frozen=True)
class PushModel:
    """Bandwidths of the push, bytes per second, each with its source."""

    # ASSUMPTION: one server's load of a safetensors export already in host memory (page cache) into its
    # GPU, generation paused: 8 GB/s, the figure behind the projection's former 2 s per load. PCIe Gen5 x16
    # carries 64 GB/s, so this assumes the load is bound by reading and converting the tensors, not the bus.
    # Measure: time /update_weights_from_disk of one server with the export in the page cache.
    load_bps: float = 8e9
    # ASSUMPTION: what one node's client reads from the shared file system: 12.5 GB/s, one 100 Gb/s storage
    # link at line rate. Measure: `dd if=EXPORT/model-00001-of-0000N.safetensors of=/dev/null bs=16M` after
    # dropping the page cache, on one node.
    node_read_bps: float = 12.5e9
    # ASSUMPTION: the shared file system's aggregate read bandwidth over all clients: 100 GB/s (a mid-sized
    # parallel file system; a shared NFS server gives one to a few GB/s). Measure: the same read from every
    # rollout node at once, total bytes over the slowest node's time.
    fs_read_bps: float = 100e9
    # ASSUMPTION: trainer rank 0 writing the export (ZeRO-3 parameters gathered, then safetensors written by
    # one process): 2 GB/s. Kept although its gather copies every tensor into fresh pageable host memory
    # (trainer full_state_dict: `.to("cpu", copy=True)`), which ran at FRESH_PAGEABLE_BYTES_S on the H100
    # VMs here: that rate is first-touch page faulting (memory written before took 12.5-16 GB/s), which a
    # Firecracker VM makes dearer than a bare-metal host, and no bare-metal node has been measured. The
    # colocated projection's sensitivity costs the gather at that rate for the split and the colocated
    # layouts alike. Measure: the trainer's `export_hf` seconds in a run's log at this size.
    export_write_bps: float = 2e9
    # From the 3-7 s other RL systems report for a weight broadcast of 27-30B models over NCCL (as quoted in
    # issue 43, not measured here; 54-60 GB in
    # bf16, so 8-20 GB/s end to end: bucketing and the servers' loading included), the low end: 10 GB/s.
    # Measure: `make gpu-smoke`'s broadcast step at the recipe's size.
    broadcast_bps: float = 10e9


def disk_push(weight_bytes: float, servers: int, *, per_node: bool = True, gpus_per_server: int = 1,
              model: PushModel = PushModel()) -> dict:
    """One push over disk to `servers` rollout servers (each `gpus_per_server` GPUs, GPUS_PER_NODE per node).

    trainer_s: the export written (the trainer's side). rollout_s: until every server holds the new
    weights (the rollout side's pause). per_node (what sglang/weights.py does): the first server of each
    node reads from the shared file system, at the lowest of its load rate, its node's link and its share of
    the aggregate; then the node's other servers load from the page cache. The client loads at most
    MAX_PARALLEL_LOADS servers of a wave at once, so a wave of more loads in rounds. Without per_node
    (every server reading the shared file system at once, as before) each node's link and the aggregate
    are shared by every server."""
    per_node_servers = max(1, GPUS_PER_NODE // gpus_per_server)
    nodes = math.ceil(servers / per_node_servers)
    trainer_s = weight_bytes / model.export_write_bps
    if per_node:
        readers, readers_per_node = nodes, 1
    else:
        readers, readers_per_node = servers, min(servers, per_node_servers)
    # the client's threads cap how many read at once: the aggregate is shared by at most that many
    rate = min(model.load_bps, model.node_read_bps / readers_per_node,
               model.fs_read_bps / min(readers, MAX_PARALLEL_LOADS))
    rollout_s = math.ceil(readers / MAX_PARALLEL_LOADS) * weight_bytes / rate
    if per_node and servers > nodes:
        # the nodes' other servers, from the page cache, MAX_PARALLEL_LOADS at a time
        rollout_s += math.ceil((servers - nodes) / MAX_PARALLEL_LOADS) * weight_bytes / model.load_bps
    return {"transport": "disk", "per_node": per_node, "servers": servers, "nodes": nodes,
            "trainer_s": trainer_s, "rollout_s": rollout_s,
            "shared_fs_reads_per_step": readers, "shared_fs_bytes_per_step": readers * weight_bytes,
            "shared_fs_bytes_per_node": weight_bytes * readers / nodes}


def broadcast_push(weight_bytes: float, servers: int, *, model: PushModel = PushModel()) -> dict:
    """One push by NCCL broadcast: the trainer and the servers busy for the same time (pipelined over the
    links, so about the bytes over one link's effective rate, whatever the number of servers)."""
    s = weight_bytes / model.broadcast_bps
    return {"transport": "broadcast", "servers": servers, "trainer_s": s, "rollout_s": s,
            "shared_fs_reads_per_step": 0, "shared_fs_bytes_per_step": 0.0, "link_bytes_per_step": weight_bytes}


def push_cost(transport: str, weight_bytes: float, servers: int, *, per_node: bool = True,
              model: PushModel = PushModel()) -> dict:
    if transport == "broadcast":
        return broadcast_push(weight_bytes, servers, model=model)
    if transport == "disk":
        return disk_push(weight_bytes, servers, per_node=per_node, model=model)
    raise ValueError(f"transport: disk or broadcast, not {transport!r}")


def describe(model: PushModel = PushModel()) -> dict:
    """The constants, for a result's assumptions."""
    return {**{k: f"{v / 1e9:g} GB/s" for k, v in asdict(model).items()},
            "weight_bytes_7b": f"{WEIGHT_BYTES_7B / 1e9:g} GB", "gpus_per_node": GPUS_PER_NODE}
