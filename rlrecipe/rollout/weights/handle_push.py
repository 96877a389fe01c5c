"""The push by handles (`weight_sync: ipc`), as every training rank takes part in it.

Every rank walks the full weights in the same buckets (a sharded trainer gathers each), copies
each bucket into a fresh shared buffer on its own device (weights/handles.py) and hands its
payload to rank 0, which posts to each server the payloads of the ranks on that server's GPUs.
Every rank keeps its buffer until rank 0's requests for the bucket have returned, and learns
whether they succeeded, so a failed push is raised on every rank instead of leaving ranks waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from rlrecipe.core.dist import broadcast_from_rank_zero, gather_to_rank_zero, is_rank_zero
from rlrecipe.rollout.weights.handles import HostMirror, SharedBucket
from rlrecipe.rollout.weights.sync import buckets

# rank 0's side: the payloads of one bucket in rank order, and whether it is the push's last
SendBucket = Callable[[list[str], bool], None]


def _with_last(items: Iterator) -> Iterator[tuple[object, bool]]:
    prev = next(items, None)
    while prev is not None:
        nxt = next(items, None)
        yield prev, nxt is None
        prev = nxt


def push_by_handles(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                    send: SendBucket | None, mirror: HostMirror | None = None) -> dict[str, torch.Tensor]:
    """Push `named` (the full weights, tied ones once, in the same order on every rank) bucket by bucket;
    `send` is rank 0's (None elsewhere). Collective. Returns, on rank 0, a copy in host memory of what
    was pushed (the verification reads it; in `mirror`'s buffers where given), and {} elsewhere."""
    mirror = mirror if mirror is not None else HostMirror()
    for chunk, last in _with_last(buckets(named, bucket_bytes)):
        shared = SharedBucket(chunk)
        payloads = gather_to_rank_zero(shared.payload)

        def post(payloads=payloads, last=last) -> None:
            send(payloads, last)

        broadcast_from_rank_zero(post)  # every rank holds its buffer until the servers have loaded it
        if is_rank_zero():
            mirror.copy(shared.views)
        del shared  # a copy still running reads it in stream order: the memory is not reused before
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # blocks the servers have let go are freed now, not at some later allocation
    return mirror.finish() if is_rank_zero() else {}
