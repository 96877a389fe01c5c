"""Starting the processes of a multi-process training stage (the DeepSpeed engine).

One command starts a run however many processes it needs: a stage whose recipe asks for more than
one (`trainer.nproc` x `trainer.nodes`) runs its command again under torchrun on this node and exits
with its status, and a command already under torchrun, or one of its children, is never relaunched.
Inside a launched process the process group is started here; ranks and broadcasts are `dist.py`'s.
docs/gpu.md ("Training over several processes and nodes") says how to run it on one node and on several.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from rlrecipe.core.dist import LAUNCHED_ENV, is_rank_zero, under_launcher
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.recipe.systems import TrainerSection

NODE_RANK_ENVS = ("RLRECIPE_NODE_RANK", "NODE_RANK", "SLURM_NODEID")
# where each launched rank leaves its exit status: torchrun itself exits 1 whatever its ranks did
STATUS_DIR_ENV = "RLRECIPE_RANK_STATUS_DIR"
# Collectives wait this long for a slow rank (e.g. rank 0 evaluating while the others wait).
TIMEOUT = timedelta(minutes=float(os.environ.get("RLRECIPE_DIST_TIMEOUT_MIN", "120")))


# -- process end ---------------------------------------------------------------------------------
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
    _leave_status(code)
    os._exit(code)


def _leave_status(code: int) -> None:
    folder, rank = os.environ.get(STATUS_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        with contextlib.suppress(OSError):
            (Path(folder) / f"rank{rank}").write_text(str(code))


def ranks_status(torchrun_rc: int, folder: Path) -> int:
    """The status of a launched stage: its ranks' own where the ranks that failed agree on one (a
    mistake in the recipe is 2, a resumable stop 75: a cluster job tells them apart), else torchrun's."""
    if torchrun_rc == 0:
        return 0
    codes = set()
    for path in folder.glob("rank*"):
        with contextlib.suppress(OSError, ValueError):
            codes.add(int(path.read_text()))
    failed = codes - {0}
    return failed.pop() if len(failed) == 1 else torchrun_rc


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
    from rlrecipe.core.console import console

    if not is_rank_zero():
        console.quiet = True
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


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


def torchrun_command(tr: TrainerSection, command: list[str]) -> list[str]:
    """torchrun starting `python COMMAND` (e.g. `-m some.module ARGS`) as `tr`'s ranks on this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tr.nproc}"]
    if tr.nodes == 1:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        cmd += [f"--nnodes={tr.nodes}", f"--node_rank={node_rank(tr.nodes)}",
                f"--master_addr={tr.master_addr}", f"--master_port={tr.master_port}"]
    return cmd + command


def maybe_relaunch(loaded: LoadedRecipe, command: list[str]) -> None:
    """Run `python COMMAND` under torchrun and exit with its status when this recipe wants several
    DeepSpeed processes; else return. `command` is the caller's own, as each rank must run it.

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
    cmd = torchrun_command(tr, command)
    with tempfile.TemporaryDirectory(prefix="rlrecipe-ranks-") as status:
        env = {**os.environ, LAUNCHED_ENV: "1", STATUS_DIR_ENV: status}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tr.nproc)))
        rc = ranks_status(subprocess.call(cmd, env=env), Path(status))
    raise SystemExit(rc)

