"""Tensors shared by handle, for `/update_weights_from_tensor` without their bytes in the request.

torch's ForkingPickler writes a tensor as a handle to its memory: a CUDA IPC handle on a GPU, a
shared-memory file's name on a CPU (the `file_system` sharing strategy; the default strategy sends a
file descriptor, which an unrelated process cannot receive). SGLang's SafeUnpickler admits both
rebuilders, so a server on the same machine maps the trainer's memory and copies from it: the
in-place push verl, slime and OpenRLHF make colocated, and, on a CPU, the same code path.

A handle names memory the sender must keep and not write until the server has loaded it (SGLang
answers once its copies are queued, not done): each bucket is a fresh buffer, dropped by the caller
only after every server's request for it returned. A payload no server reads (a failed push) keeps
its shared file until the process ends. A CUDA handle names its device by index, which
means another GPU to a server started with another CUDA_VISIBLE_DEVICES: SGLang's receiving side
maps a device UUID back to its own index (utils/patch_torch.py), so the UUID is what is sent.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import reductions

DEVICE_ARG = 6  # rebuild_cuda_tensor's argument that names the device (torch's reductions.reduce_tensor)


def _reduce_naming_device_uuid(t: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(t)
    if rebuild is reductions.rebuild_cuda_tensor:
        uuid = str(torch.cuda.get_device_properties(args[DEVICE_ARG]).uuid)
        args = (*args[:DEVICE_ARG], uuid, *args[DEVICE_ARG + 1:])
    return rebuild, args


class _HandlePickler(ForkingPickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_naming_device_uuid


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """CPU storages shared by file name (a process on this machine opens it) inside the block."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


class SharedBucket:
    """Named tensors copied into one fresh buffer (shared memory on a CPU, the tensors' own GPU on
    CUDA), and the handle payload a server rank reads: base64 of the pickled list of (name, view).
    Keep the object alive until the servers have loaded it."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        device = named[0][1].device
        dtypes = {t.dtype for _, t in named}
        with file_system_sharing():
            # one storage per dtype: a bucket's tensors share one handle each, not one per tensor
            flats = {dt: torch.empty(sum(t.numel() for _, t in named if t.dtype == dt), dtype=dt, device=device)
                     for dt in sorted(dtypes, key=str)}
            if device.type == "cpu":
                for flat in flats.values():
                    flat.share_memory_()
            offsets = dict.fromkeys(flats, 0)
            self.views: list[tuple[str, torch.Tensor]] = []
            for name, t in named:
                n = t.numel()
                view = flats[t.dtype][offsets[t.dtype]:offsets[t.dtype] + n].view(t.shape)
                view.copy_(t.detach())
                offsets[t.dtype] += n
                self.views.append((name, view))
            buf = io.BytesIO()
            _HandlePickler(buf).dump(self.views)
        self._flats = flats
        self.payload = base64.b64encode(buf.getvalue()).decode("ascii")

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self._flats.values())


class HostMirror:
    """Rank 0's copy in host memory of what it pushed, which the verification reads. From a GPU it is
    copied into pinned buffers kept from one push to the next: into fresh pageable memory the copy ran
    at 1.3 GB/s on an H100, into pinned memory at 54 GB/s (bench/gpu/ipc_push_h100.json)."""

    def __init__(self):
        self._host: dict[str, torch.Tensor] = {}

    def copy(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Start copying these tensors (asynchronous from a GPU: `finish` waits)."""
        for name, t in named:
            host = self._host.get(name)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=t.is_cuda)

    def finish(self) -> dict[str, torch.Tensor]:
        """Every tensor copied since the last push, complete (overwritten by the next push)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return dict(self._host)


def ranks_read_by(server: int, tp_size: int, world_size: int) -> list[int]:
    """The trainer rank whose handles each tensor-parallel rank of server `server` reads: rank j of
    server i sits on GPU i x tp_size + j, as the trainer rank of that number does colocated (in a
    split layout on one machine, a handle opens on any of its GPUs, and the server copies across).
    Each payload is read once: its pickling took one reference to the memory and the reading gives
    it back, so a trainer rank per server GPU is needed."""
    ranks = [server * tp_size + j for j in range(tp_size)]
    if ranks[-1] >= world_size:
        raise ValueError(f"server {server}'s tensor-parallel ranks read trainer ranks {ranks[0]}-{ranks[-1]}, "
                         f"and the trainer has {world_size}: weight_sync ipc needs a trainer rank per server GPU")
    return ranks
