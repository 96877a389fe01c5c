"""A job's node commands started by hand, one process per "node" on this machine, each with the
variables a Slurm step gives it (SLURMD_NODENAME in SLURM_JOB_NODELIST, the batch script's port) and
its own loopback address for a host. The real Slurm here (tests/cluster/test_slurm_jobs.py) has two
nodes; this is for what it cannot hold: a third node, and one node's command started again alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rlrecipe.cluster import node as node_module


def host(n: int) -> str:
    return f"127.0.0.{n + 1}"


def start_nodes(recipe: Path, nodes: int, gpus_per_node: int, port: int, *extra: str,
                only: int | None = None) -> list[subprocess.Popen]:
    """One `rlrecipe cluster-node` per node (`only`: that node alone), each in its own process group."""
    procs = []
    for n in range(nodes) if only is None else [only]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_NODEID": "0",
               "SLURMD_NODENAME": host(n), "SLURM_JOB_NODELIST": ",".join(host(i) for i in range(nodes)),
               node_module.PORT_ENV: str(port)}
        env.pop("SGLANG_API_KEY", None)
        log = open(recipe.parent / f"node{n}.log", "ab")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, "-m", "rlrecipe.cli.app", "cluster-node", str(recipe),
                                       "--gpus-per-node", str(gpus_per_node), *extra], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen], sig=signal.SIGKILL) -> None:
    """`sig` to each node's process group."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        p.wait(timeout=60)


def node_dies(proc: subprocess.Popen) -> None:
    """Every process of a node gone at once (torchrun starts its ranks in sessions of their own, so
    the node's process group alone would leave them running)."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


def node_log(recipe: Path, n: int) -> str:
    return (recipe.parent / f"node{n}.log").read_text(errors="replace")
