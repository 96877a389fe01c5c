"""Process launch and rank helpers for multi-process training (the DeepSpeed engine).

One command starts a run however many processes it needs: a stage whose recipe asks for more than
one (`trainer.nproc` x `trainer.nodes`) runs itself again under torchrun on this node and exits with
its status, and a command already under torchrun, or one of its children, is never relaunched.
Rank 0 alone writes the run's records and prints, and in RL it owns the rollout engine, the pool
and the grader, broadcasting each graded batch to the other ranks as flat arrays rather than
pickled lists. docs/gpu.md ("Training over several processes and nodes") says how to run it on
one node and on several.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn, TypeVar

from rlrecipe.errors import UserError
from rlrecipe.recipe import LoadedRecipe, RecipeError, TrainerSection

if TYPE_CHECKING:
    from rlrecipe.trajectory_arrays import TrajectoryBatch

LAUNCHED_ENV = "RLRECIPE_LAUNCHED"
NODE_RANK_ENVS = ("RLRECIPE_NODE_RANK", "NODE_RANK", "SLURM_NODEID")
# Collectives wait this long for a slow rank (e.g. rank 0 evaluating while the others wait).
TIMEOUT = timedelta(minutes=float(os.environ.get("RLRECIPE_DIST_TIMEOUT_MIN", "120")))

T = TypeVar("T")


# -- rank queries: 0 of 1 until a process group is started ----------------------------------------
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world_size() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def is_rank_zero() -> bool:
    return rank() == 0


def barrier() -> None:
    d = _dist()
    if d and d.get_world_size() > 1:
        d.barrier()


def under_launcher() -> bool:
    """True inside a process started by torchrun (ours or the user's)."""
    return bool(os.environ.get(LAUNCHED_ENV)) or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def is_launched_rank() -> bool:
    """This process is one rank of several that torchrun started."""
    return under_launcher() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def end_process(code: int | str | None) -> NoReturn:
    """End this process with `code` once Python's exit handlers have run (the process group
    destroyed, W&B finished, logs flushed), skipping the interpreter's teardown.

    A rank of a multi-process group can abort in that teardown after all its work is done
    ("terminate called without an active exception": a C++ thread of the group's machinery
    destroyed while still joinable), and torchrun then reports the finished stage as failed. The
    two-rank DeepSpeed test's worker did so in about 1 CI run in 10 until it left this way."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as Python does
        with contextlib.suppress(Exception):
            print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


# -- process group -------------------------------------------------------------------------------
def init_distributed() -> None:
    """Start the default process group once: from torchrun's environment, else a 1-process group.

    gloo on CPU, nccl on CUDA. A 1-process group uses an in-memory store, so it needs no port.
    DeepSpeed finds the group already started and uses it.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if under_launcher() and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=TIMEOUT)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def quiet_other_ranks() -> None:
    """Only rank 0 prints: the shared rich console goes silent on the others."""
    from rlrecipe.console import console

    if not is_rank_zero():
        console.quiet = True
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def broadcast_from_rank_zero(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and hand its result to every rank (e.g. files only rank 0 may write).

    An exception on rank 0 is raised there; the other ranks exit quietly with status 1.
    """
    d = _dist()
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

    d = _dist()
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
    d = _dist()
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


def broadcast_batch_from_rank_zero(fn: Callable[[], tuple[TrajectoryBatch, T]]) -> tuple[TrajectoryBatch, T]:
    """Rank 0's `(batch, small)` from `fn` on every rank: the batch's arrays by tensor broadcast, its
    uids and group ids and `small` pickled. No rank unpickles per-token Python lists."""
    from rlrecipe.trajectory_arrays import TrajectoryBatch

    def parts():
        batch, small = fn()
        return batch.arrays, (batch.uids, batch.group_ids, small)

    arrays, (uids, group_ids, small) = broadcast_arrays_from_rank_zero(parts)
    return TrajectoryBatch(arrays, uids, group_ids), small


# -- relaunch under torchrun ---------------------------------------------------------------------
def node_rank(nodes: int) -> int:
    for key in NODE_RANK_ENVS:
        if os.environ.get(key, "").strip():
            value = os.environ[key].strip()
            if not value.isdigit() or int(value) >= nodes:
                raise UserError(f"{key}={value}: expected a node rank in 0..{nodes - 1} (trainer.nodes = {nodes})")
            return int(value)
    if nodes > 1:
        raise UserError(f"trainer.nodes = {nodes}: set RLRECIPE_NODE_RANK=<0..{nodes - 1}> on every node")
    return 0


def torchrun_command(tr: TrainerSection, cli_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tr.nproc}"]
    if tr.nodes == 1:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        cmd += [f"--nnodes={tr.nodes}", f"--node_rank={node_rank(tr.nodes)}",
                f"--master_addr={tr.master_addr}", f"--master_port={tr.master_port}"]
    return cmd + ["-m", "rlrecipe.cli.app", *cli_args]


def cli_args_for(stage: str, loaded: LoadedRecipe, resume: bool, overwrite: bool = False) -> list[str]:
    args = [stage, str(loaded.path)]
    for item in loaded.overrides:
        args += ["--set", item]
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])


def maybe_relaunch(stage: str, loaded: LoadedRecipe, resume: bool = False, overwrite: bool = False) -> None:
    """Start torchrun and exit when this recipe wants several DeepSpeed processes; else return.

    Inside a launched process: start the process group and silence ranks other than 0.
    """
    tr = loaded.recipe.trainer
    world = tr.nproc * tr.nodes
    if under_launcher():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            if tr.engine != "deepspeed":
                raise RecipeError(f"{loaded.path}: trainer.engine: {tr.engine} runs in one process; use "
                                  "trainer.engine: deepspeed to train with several")
            init_distributed()
            quiet_other_ranks()
        return
    if tr.engine != "deepspeed" or world == 1:
        return
    cmd = torchrun_command(tr, cli_args_for(stage, loaded, resume, overwrite))
    env = {**os.environ, LAUNCHED_ENV: "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tr.nproc)))
    rc = subprocess.call(cmd, env=env)
    raise SystemExit(rc)
