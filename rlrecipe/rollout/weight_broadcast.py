"""The trainer's side of `weight_sync: distributed` for an SGLang engine: its update group and pushes.

The group's protocol and collectives are in `weight_sync.py`; this module drives them over the
engine's live servers, seen as `LiveServers` (what it needs of the engine and no more): it makes
the group on the first push (this process rank 0, then each live server's tensor-parallel ranks),
sends the weights in buckets, and leaves the group when a push fails (a broadcast nobody received
would desynchronise every later one), when a server was left out or taken back (the group counts
the old set: it is made again before the next push, so a server started again joins it), and on
close.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.weight_sync import (
    DEFAULT_GROUP,
    broadcast,
    buckets,
    distinct_tensors,
    dtype_name,
    init_custom_group,
    run_beside,
)

if TYPE_CHECKING:
    from rlrecipe.recipe.systems import SGLangServer


class LiveServers(Protocol):
    """The servers a broadcast reaches: their settings, URLs, which are still in use, and requests to one."""

    cfg: SGLangServer
    urls: list[str]
    live: list[int]

    def server_info(self, i: int) -> dict: ...

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...

    def control(self, i: int, path: str, body: dict, read_timeout: float) -> None: ...


class WeightBroadcast:
    def __init__(self, servers: LiveServers):
        self.servers = servers
        self.group = None  # made on the first push
        self._stale = False

    def push(self, state_dict: dict, version: int) -> None:
        """Broadcast the weights into every live server, tagged with `version`; nothing touches disk."""
        cfg = self.servers.cfg
        if self._stale:
            self.close()
            self._stale = False
        if self.group is None:
            self._init_group()
        device = "cuda" if cfg.weight_sync_backend == "nccl" else "cpu"
        chunks = list(buckets(distinct_tensors(state_dict), cfg.weight_sync_bucket_mb << 20))
        try:
            self._broadcast_chunks(chunks, version, device)
        except BaseException:
            self.close()  # a broadcast nobody received would desynchronise every later one
            raise

    def members_changed(self) -> None:
        """A server was left out or taken back: the group counts the old set, so make it again
        before the next push."""
        if self.group is not None:
            self._stale = True

    def close(self) -> None:
        """Leave the weight update group on both sides (servers that are gone left it already)."""
        if self.group is None:
            return
        srv = self.servers
        for i in srv.live:
            try:
                srv.post(i, "/destroy_weights_update_group", {"group_name": DEFAULT_GROUP}, timeout=10)
            except UserError:
                pass
        dist.destroy_process_group(self.group)
        self.group = None

    def _init_group(self) -> None:
        """Make the weight update group: this process is rank 0, then each server's tp ranks."""
        srv = self.servers
        cfg = srv.cfg
        sizes = []
        for i in srv.live:
            info = srv.server_info(i)
            if int(info.get("dp_size", 1) or 1) != 1:
                raise UserError(f"rollout.sglang.weight_sync: distributed needs dp_size 1 per server "
                                f"({srv.urls[i]} has {info['dp_size']}); run more servers instead")
            sizes.append(int(info.get("tp_size", cfg.tp_size) or cfg.tp_size))
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        bodies = [{"master_address": cfg.weight_sync_address, "master_port": cfg.weight_sync_port,
                   "rank_offset": offsets[k], "world_size": world, "group_name": DEFAULT_GROUP,
                   "backend": cfg.weight_sync_backend} for k in range(len(srv.live))]
        group = []
        run_beside([lambda i=i, k=k: srv.control(i, "/init_weights_update_group", bodies[k], 900.0)
                    for k, i in enumerate(srv.live)],
                   lambda: group.append(init_custom_group(cfg.weight_sync_backend, cfg.weight_sync_address,
                                                          cfg.weight_sync_port, 0, world, DEFAULT_GROUP)))
        self.group = group[0]

    def _broadcast_chunks(self, chunks: list, version: int, device: str) -> None:
        srv = self.servers
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            tensors = [t.detach().to(device).contiguous() for _, t in chunk]
            body = {"names": [n for n, _ in chunk], "dtypes": [dtype_name(t.dtype) for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": DEFAULT_GROUP, "flush_cache": last}
            if last:
                body["weight_version"] = str(version)
            run_beside([lambda i=i, body=body: srv.control(i, "/update_weights_from_distributed", body, 3600.0)
                        for i in srv.live],
                       lambda tensors=tensors: broadcast(self.group, tensors))
