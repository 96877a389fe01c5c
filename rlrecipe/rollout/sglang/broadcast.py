"""The trainer's side of `weight_sync: distributed` for an SGLang engine: its update group and pushes.

The group's protocol and collectives are in `weights/sync.py`; this module drives them over the
engine's live servers, seen as `LiveServers` (what it needs of the engine and no more): it makes
the group on the first push (this process rank 0, then each live server's tensor-parallel ranks),
sends the weights in buckets, and leaves the group when a push fails (a broadcast nobody received
would desynchronise every later one; one that failed part-way, `BroadcastCut`, leaves the servers
that joined it waiting in it, so the run stops there), when a server was left out or taken back (the group counts
the old set: it is made again before the next push, so a server started again joins it), and on
close.

From SGLang 0.5.21 a distributed update is refused unless it runs inside a weight-update session
(`/begin_weight_update` ... `/end_weight_update`): each push opens one on every live server that
has it (known from the server's version, or from a 404 on older ones) and closes it, also when the
push fails, so the next push can open it again. A session a killed client left open is closed and
opened again, once (`sglang/session.py`). SGLang before 0.5.3 has no
`/destroy_weights_update_group`, so a group made again takes a new name there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from rlrecipe.core.errors import ResumableStop, UserError
from rlrecipe.modeling import distinct_tensors
from rlrecipe.rollout.sglang.session import (  # noqa: F401 - SESSION_LEFT_OPEN, SESSION_S kept importable here
    SESSION_LEFT_OPEN,
    SESSION_S,
    in_session,
    session,
)
from rlrecipe.rollout.weights.sync import (
    DEFAULT_GROUP,
    TIMEOUT,
    broadcast,
    buckets,
    dtype_name,
    init_custom_group,
    run_beside,
)

if TYPE_CHECKING:
    from rlrecipe.recipe.systems import SGLangServer
    from rlrecipe.rollout.sglang.versions import Dialect

class BroadcastCut(ResumableStop):
    """A push failed once servers had joined its collective (a server lost or refusing mid-push):
    those still up wait in it, so no push can follow in this run."""


class LiveServers(Protocol):
    """The servers a broadcast reaches: their settings, URLs, which are still in use, and requests to one."""

    cfg: SGLangServer
    urls: list[str]
    live: list[int]

    def server_info(self, i: int) -> dict: ...

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...

    def control(self, i: int, path: str, body: dict, read_timeout: float) -> None: ...

    def dialect(self, i: int) -> Dialect: ...


class WeightBroadcast:
    def __init__(self, servers: LiveServers):
        self.servers = servers
        self.group = None  # made on the first push
        self.group_name = DEFAULT_GROUP
        self._made = 0  # groups made so far: one made again takes a new name (see the module's docstring)
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

    @property
    def needs_group(self) -> bool:
        """The next push makes the group (again): a rendezvous every member must join."""
        return self.group is None or self._stale

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
            if not srv.dialect(i).destroy_group:
                continue
            try:
                srv.post(i, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=10)
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
        self.group_name = DEFAULT_GROUP if not self._made else f"{DEFAULT_GROUP}_{self._made}"
        self._made += 1
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        bodies = [{"master_address": cfg.weight_sync_address, "master_port": cfg.weight_sync_port,
                   "rank_offset": offsets[k], "world_size": world, "group_name": self.group_name,
                   "backend": cfg.weight_sync_backend} for k in range(len(srv.live))]
        group = []
        run_beside([lambda i=i, k=k: srv.control(i, "/init_weights_update_group", bodies[k], 900.0)
                    for k, i in enumerate(srv.live)],
                   lambda: group.append(init_custom_group(cfg.weight_sync_backend, cfg.weight_sync_address,
                                                          cfg.weight_sync_port, 0, world, self.group_name)))
        self.group = group[0]

    def _session(self, action: str, servers: list[int], failing: bool = False) -> list[int]:
        """/begin_weight_update or /end_weight_update on `servers` (sglang/session.py)."""
        return session(self.servers, action, servers, failing)

    def _broadcast_chunks(self, chunks: list, version: int, device: str) -> None:
        with in_session(self.servers, list(self.servers.live)):
            try:
                self._send_chunks(chunks, version, device)
            except Exception as err:
                raise BroadcastCut(f"{err}\nThe weight broadcast stopped part-way: the servers that took "
                                   f"its request may wait in it until its timeout ({TIMEOUT}), so it is not "
                                   "made again in this run; resume the run (--resume) once the rollout "
                                   "servers answer") from err

    def _send_chunks(self, chunks: list, version: int, device: str) -> None:
        srv = self.servers
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            tensors = [t.detach().to(device).contiguous() for _, t in chunk]
            body = {"names": [n for n, _ in chunk], "dtypes": [dtype_name(t.dtype) for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name, "flush_cache": last}
            if last:
                body["weight_version"] = str(version)
            run_beside([lambda i=i, body=body: srv.control(i, "/update_weights_from_distributed", body, 3600.0)
                        for i in srv.live],
                       lambda tensors=tensors: broadcast(self.group, tensors))
