"""Weight sync by broadcast: the trainer sends tensors straight into SGLang servers' memory.

SGLang's protocol (`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`): the trainer is rank 0 of a process group of its own with every
server rank (server i's tensor-parallel ranks are 1 + i * tp .. 1 + (i + 1) * tp - 1). Each
update is an HTTP request naming the tensors (names, dtypes, shapes) followed by one broadcast per
tensor from rank 0, in that order; the server loads what it received and flushes its cache.

The group is made exactly as SGLang makes its side (tcp rendezvous with the trainer as the store's
master, a store prefixed with the group name, a process group outside the default one), so the two
meet; `rlrecipe serve` uses the same function for its side, which is how this runs on CPU (gloo).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"
TIMEOUT = datetime.timedelta(minutes=10)


def init_custom_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout: datetime.timedelta = TIMEOUT,
                      join_timeout: datetime.timedelta | None = None):
    """A process group next to (not replacing) any default group; collective over its members.

    `join_timeout` bounds only the wait for the rendezvous (an unreachable trainer); `timeout`
    bounds every later collective (a broadcast of large weights)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size,
                                              timeout=join_timeout or timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `max_bytes` (a bigger tensor goes alone): bounds what a server
    must allocate for one request."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def receive(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
            device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """The server side of one update: one broadcast from rank 0 per tensor, in the order named."""
    out, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        handles.append(dist.broadcast(t, src=0, group=group, async_op=True))
        out.append((name, t))
    for h in handles:
        h.wait()
    return out


def broadcast(group, tensors: list[torch.Tensor]) -> list:
    """The trainer side of one update: start one broadcast per tensor from rank 0 (async handles)."""
    return [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]


def run_beside(requests_to_send: list[Callable[[], None]], work: Callable[[], list | None]) -> None:
    """Send blocking HTTP requests in threads while this thread does its side of the collective.

    Each server answers only once the collective is done, so the requests must be in flight before
    `work` starts and are collected after it. `work` may return async handles: they are polled, so
    a server that refuses the request fails the call at once instead of leaving a broadcast to
    wait for it. Raises the first error of either side."""
    errors: list[BaseException] = []

    def call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=call, args=(fn,), daemon=True) for fn in requests_to_send]
    for t in threads:
        t.start()
    handles = work() or []
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not all(h.is_completed() for h in handles):
        if errors:
            raise errors[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight broadcast not received within {TIMEOUT}")
        time.sleep(0.005)
    for h in handles:
        h.wait()
    for t in threads:
        t.join(timeout=TIMEOUT.total_seconds())
    if errors:
        raise errors[0]
