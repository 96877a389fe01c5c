"""Weights into SGLang servers by `/update_weights_from_tensor`: by value (`weight_sync: tensor`) or
by handle (`weight_sync: ipc`).

The body (sglang/srt/managers/io_struct.py, UpdateWeightsFromTensorReqInput) carries
`serialized_named_tensors`: one base64 string per tensor-parallel rank, each a pickled list of
(name, tensor); rank k unpickles entry k with SGLang's SafeUnpickler (utils/common.py). The
tensors are pickled here by value (plain pickle: each storage travels in the request, rebuilt
with torch.storage._load_from_bytes, which SafeUnpickler admits as a weights_only torch.load).
torch's ForkingPickler would send handles instead (CUDA IPC on a GPU; on a CPU a file descriptor,
which an unrelated process cannot receive, or a shm file name under the `file_system` sharing
strategy), which reach only a server on the same machine and leave the memory's lifetime to the
sender; by value works on a CPU and across machines, at the cost of the bytes on the wire. The push
by handle (`handle_session`, weights/handles.py) is that other way: every training rank shares its
own copy, and each server rank reads the handles of the trainer rank on its GPU.

Each push serializes fresh copies (no storage of the trainer's is pickled whole, nor reused after
the call) in buckets of `weight_sync_bucket_mb` (weights/sync.py `buckets`), inside SGLang's
weight-update session where the version has one (sglang/session.py). The last bucket carries
`flush_cache` and `weight_version`.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import distinct_tensors
from rlrecipe.recipe.systems import MAX_PARALLEL_LOADS, SGLangServer
from rlrecipe.rollout.sglang.down import failed_push
from rlrecipe.rollout.sglang.session import in_session
from rlrecipe.rollout.sglang.versions import Dialect
from rlrecipe.rollout.weights.handles import ranks_read_by
from rlrecipe.rollout.weights.sync import buckets

PATH = "/update_weights_from_tensor"
PUSH_S = 3600.0


class TensorServers(Protocol):
    cfg: SGLangServer
    urls: list[str]
    live: list[int]

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...

    def control(self, i: int, path: str, body: dict, read_timeout: float) -> None: ...

    def dialect(self, i: int) -> Dialect: ...

    def server_info(self, i: int) -> dict: ...


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's payload: base64 of the pickled list of (name, tensor), the tensors copied onto the CPU."""
    fresh = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in named]
    return base64.b64encode(pickle.dumps(fresh, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def tensor_bodies(state_dict: dict, version: int, bucket_bytes: int, ranks: int) -> Iterator[dict]:
    """The /update_weights_from_tensor bodies of one push, one per bucket, made as they are asked for
    (the copies of the whole model never sit in memory at once), for a server of `ranks`
    tensor-parallel ranks (each reads its own copy of the payload)."""
    chunks = list(buckets(distinct_tensors(state_dict), bucket_bytes))
    for k, chunk in enumerate(chunks):
        yield _body([serialize_named_tensors(chunk)] * ranks, k == len(chunks) - 1, version)


def _body(payloads: list[str], last: bool, version: int) -> dict:
    """One bucket's request: a payload per tensor-parallel rank; the last bucket flushes the cache and
    names the version."""
    body = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": last}
    if last:
        body["weight_version"] = str(version)
    return body


def tp_size(srv: TensorServers, i: int) -> int:
    return int(srv.server_info(i).get("tp_size", srv.cfg.tp_size) or srv.cfg.tp_size)


def push_tensors(srv: TensorServers, state_dict: dict, version: int) -> None:
    """Every live server takes `state_dict` by /update_weights_from_tensor, server by server, each
    inside its weight-update session."""
    bucket_bytes = srv.cfg.weight_sync_bucket_mb << 20
    for i in list(srv.live):
        try:
            with in_session(srv, [i]):
                for body in tensor_bodies(state_dict, version, bucket_bytes, tp_size(srv, i)):
                    srv.control(i, PATH, body, PUSH_S)
        except UserError as err:
            failed_push(srv, i, err)


@contextmanager
def handle_session(srv: TensorServers, version: int, world_size: int) -> Iterator:
    """The servers' side of a push by handles (weights/handle_push.py): every live server's session
    opened; yields `send(payloads, last)`, which posts one bucket's payloads (one per trainer rank,
    in rank order) to every live server, each server rank reading its GPU's trainer rank; closed
    after, also when the push fails."""
    live, reads = [], {}
    for i in list(srv.live):
        try:
            reads[i] = _ranks_read(srv, i, world_size)
        except UserError as err:
            failed_push(srv, i, err)  # down, with retry: left out, the push goes on to the others
            continue
        live.append(i)

    def post(i: int, payloads: list[str], last: bool) -> None:
        srv.control(i, PATH, _body([payloads[r] for r in reads[i]], last, version), PUSH_S)

    def send(payloads: list[str], last: bool) -> None:
        # the servers side by side (a request carries names, not bytes: each server's own copy is the
        # work), MAX_PARALLEL_LOADS at once as the loads from disk
        with ThreadPoolExecutor(max_workers=max(1, min(len(live), MAX_PARALLEL_LOADS))) as pool:
            futures = {i: pool.submit(post, i, payloads, last) for i in live}
        for i, fut in futures.items():
            try:
                fut.result()
            except UserError as err:
                failed_push(srv, i, err)  # down, with retry: left out, the rest of the push goes on
                live.remove(i)

    with in_session(srv, live, failed=lambda i, err: failed_push(srv, i, err)):
        live[:] = [i for i in live if i in srv.live]  # not those left out when their session began
        yield send


def _ranks_read(srv: TensorServers, i: int, world_size: int) -> list[int]:
    """The trainer ranks whose payloads server i's ranks read (weights/handles.py ranks_read_by)."""
    dp = int(srv.server_info(i).get("dp_size", 1) or 1)
    if dp > 1:  # every data-parallel replica would read the same entries
        raise UserError(f"SGLang server {srv.urls[i]} runs dp_size {dp}: weight_sync ipc needs "
                        "servers of one replica each (more servers instead), or weight_sync disk")
    try:
        return ranks_read_by(i, tp_size(srv, i), world_size)
    except ValueError as err:
        raise UserError(f"SGLang server {srv.urls[i]}: {err}") from None
