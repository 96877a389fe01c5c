"""Ranks and broadcasts from rank 0: what every part of a multi-process run asks of its process group.

Until a process group is started this is rank 0 of 1, and every broadcast just calls its function,
so single-process code needs no branch of its own. Under torchrun, rank 0 alone writes the run's
records, owns the rollout engine, the pool and the grader, and hands each graded batch to the
other ranks as flat arrays rather than pickled lists. Starting and relaunching processes is
`train/launch.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

# Set in the processes a relaunch starts, so that they do not launch again.
LAUNCHED_ENV = "RLRECIPE_LAUNCHED"

T = TypeVar("T")


# -- rank queries: 0 of 1 until a process group is started ----------------------------------------
def _group():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _group()
    return d.get_rank() if d else 0


def world_size() -> int:
    d = _group()
    return d.get_world_size() if d else 1


def is_rank_zero() -> bool:
    return rank() == 0


def barrier() -> None:
    d = _group()
    if d and d.get_world_size() > 1:
        d.barrier()


def under_launcher() -> bool:
    """True inside a process started by torchrun (ours or the user's)."""
    return bool(os.environ.get(LAUNCHED_ENV)) or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def is_launched_rank() -> bool:
    """This process is one rank of several that torchrun started."""
    return under_launcher() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def gather_to_rank_zero(obj: T) -> list[T] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere). Collective."""
    d = _group()
    if d is None or d.get_world_size() == 1:
        return [obj]
    out: list | None = [None] * d.get_world_size() if d.get_rank() == 0 else None
    d.gather_object(obj, out, dst=0)
    return out


# -- broadcasts from rank 0 -----------------------------------------------------------------------
def broadcast_from_rank_zero(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and hand its result to every rank (e.g. files only rank 0 may write).

    An exception on rank 0 is raised there; the other ranks exit quietly with status 1.
    """
    d = _group()
    if d is None or d.get_world_size() == 1:
        return fn()
    box: list = [None]
    if d.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException:
            d.broadcast_object_list([("error", None)], src=0)
            raise
    d.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise SystemExit(1)
    return value


# Under nccl, tensors travel through a buffer on the GPU this many bytes at a time, so a multi-GiB
# batch never needs its whole size free on the device (the model and optimizer are already there).
DEVICE_CHUNK_BYTES = 64 * 2**20


def broadcast_arrays_from_rank_zero(fn: Callable[[], tuple[dict, T]]) -> tuple[dict, T]:
    """As `broadcast_from_rank_zero`, for a result `(tensors, small)`: a dict of named CPU tensors,
    sent with `torch.distributed.broadcast` as raw bytes, and a small picklable value sent with
    their names, shapes and dtypes through `broadcast_object_list`. Every rank gets CPU tensors
    (rank 0 its own). The error behaviour is `broadcast_from_rank_zero`'s: fn runs inside it."""
    import torch

    d = _group()
    if d is None or d.get_world_size() == 1:
        return fn()
    lead = d.get_rank() == 0
    held: dict = {}

    def describe():
        tensors, small = fn()
        held.update(tensors)
        return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, small

    layout, small = broadcast_from_rank_zero(describe)
    tensors = held if lead else {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
    staging = None
    if d.get_backend() == "nccl":  # nccl moves CUDA tensors only; gloo broadcasts the CPU tensors in place
        largest = max((t.numel() * t.element_size() for t in tensors.values()), default=0)
        staging = torch.empty(max(1, min(DEVICE_CHUNK_BYTES, largest)), dtype=torch.uint8,
                              device=torch.device("cuda", torch.cuda.current_device()))
    for name in layout:  # dict order: the same on every rank
        t = tensors[name]
        if t.numel():
            _broadcast_bytes(t.contiguous().view(-1).view(torch.uint8), staging, lead)
    return tensors, small


def _broadcast_bytes(data, staging, lead: bool) -> None:
    """Rank 0's `data` (a flat uint8 CPU tensor) into every rank's `data`, directly or through the
    device buffer `staging`."""
    d = _group()
    if staging is None:
        d.broadcast(data, src=0)
        return
    for start in range(0, data.numel(), staging.numel()):
        n = min(staging.numel(), data.numel() - start)
        chunk = staging[:n]
        if lead:
            chunk.copy_(data[start:start + n])
        d.broadcast(chunk, src=0)
        if not lead:
            data[start:start + n].copy_(chunk)
