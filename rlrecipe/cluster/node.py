"""`rlrecipe cluster-node`: what one node of a Slurm job runs, decided from Slurm's variables.

- **Where it is.** This node's place in the job is where its name (`SLURMD_NODENAME`) stands in
  the job's hosts (`SLURM_JOB_NODELIST`). `SLURM_NODEID` cannot tell it: Slurm numbers the nodes
  of each step from 0, so a rollout step started with `--relative=1` sees 0. The first host holds
  the trainer's rendezvous, at the port the batch script chose (`RLRECIPE_MASTER_PORT`).
- **Its role** (`cluster/layout.py`):
  - a training node runs the stage with that node rank;
  - a rollout node runs `rlrecipe rollout-servers` for its share;
  - a colocated node does both and stops its servers when training ends.
- **Where servers listen.** Other nodes reach a node's servers by its name, so servers the recipe
  binds to loopback (`rollout.sglang.host`, 127.0.0.1 by default) bind to that name instead.
- **The server list.** Rollout nodes list their servers in `<run dir>/rollout_urls.yaml`, and
  training nodes wait for the whole list before starting. The wait is bounded by
  `rollout.sglang.startup_timeout_s`, and when it runs out one line says which servers never
  reported.
- **Exit status.** The node exits with its trainer's status.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.cluster.layout import BOTH, ROLLOUT, JobLayout, job_layout
from rlrecipe.cluster.nodelist import expand_nodelist
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.rollout.sglang.node_servers import read_urls

PORT_ENV = "RLRECIPE_MASTER_PORT"
URLS_FILE = "rollout_urls.yaml"
URLS_GRACE_S = 60.0  # beyond the servers' own start-up: the rollout nodes' scheduling and imports
POLL_S = 1.0


@dataclass(frozen=True)
class Place:
    node: int
    hosts: list[str]
    port: int

    @property
    def head(self) -> str:
        return self.hosts[0]


def place_from_env(env: Mapping[str, str], default_port: int) -> Place:
    """This node's place in the job, from the variables Slurm sets (and the batch script's port)."""
    name = env.get("SLURMD_NODENAME", "").strip()
    if not name:
        raise UserError("SLURMD_NODENAME is not set: run `rlrecipe cluster-node` inside a Slurm job step "
                        "(srun), which sets it")
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST", ""))
    if name not in hosts:
        raise UserError(f"SLURMD_NODENAME={name!r} is not among the job's hosts (SLURM_JOB_NODELIST="
                        f"{env.get('SLURM_JOB_NODELIST')!r})")
    port = env.get(PORT_ENV, "").strip() or str(default_port)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{PORT_ENV}={port!r}: expected a TCP port")
    return Place(hosts.index(name), hosts, int(port))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def urls_path(loaded: LoadedRecipe) -> Path:
    return loaded.recipe.run.dir / URLS_FILE


def wait_for_urls(path: Path, expected: int, timeout_s: float) -> list[str]:
    """The full server list once the rollout nodes have written it, or one line saying what is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        urls = read_urls(path)  # rollout-servers writes it whole (atomic), under its lock
        if len(urls) >= expected:
            return urls
        if time.monotonic() > deadline:
            raise UserError(f"{path}: {len(urls)} of {expected} rollout servers listed after {timeout_s:.0f}s: a "
                            "rollout node never came up or its servers never answered (see its rollout-servers "
                            "output and sglang_server_*.log); the job stops here, and --resume continues it")
        time.sleep(POLL_S)


def cli() -> list[str]:
    return [sys.executable, "-m", "rlrecipe.cli.app"]


def trainer_command(loaded: LoadedRecipe, stage: str, overrides: list[str], place: Place, urls: list[str] | None,
                    resume: bool) -> list[str]:
    sets = [f"trainer.master_addr={place.head}", f"trainer.master_port={place.port}"]
    if urls is not None:
        sets.append("rollout.urls=[" + ",".join(urls) + "]")
    return [*cli(), stage, str(loaded.path), *[x for s in [*overrides, *sets] for x in ("--set", s)],
            *(["--resume"] if resume else [])]


def rollout_command(loaded: LoadedRecipe, overrides: list[str], layout: JobLayout, place: Place) -> list[str]:
    share = place.node if layout.colocated_nodes else place.node - layout.train_nodes
    name = place.hosts[place.node]
    # a server bound to loopback answers no other node, whatever name it is listed under
    bind = [f"rollout.sglang.host={name}"] if is_loopback(loaded.recipe.rollout.sglang.host) else []
    return [*cli(), "rollout-servers", str(loaded.path), "--node", str(share), "--urls-out", str(urls_path(loaded)),
            "--url-host", name, "--log-dir", str(loaded.recipe.run.dir / f"rollout_node{share}"),
            *[x for s in [*overrides, *bind] for x in ("--set", s)]]


def run_node(loaded: LoadedRecipe, overrides: list[str], *, stage: str, gpus_per_node: int, resume: bool,
             env: Mapping[str, str] = os.environ) -> int:
    """This node's part of the job; the trainer's exit status (a rollout node's when it serves only)."""
    recipe = loaded.recipe
    layout = job_layout(recipe, gpus_per_node, serving=stage == "rl")
    place = place_from_env(env, recipe.trainer.master_port)
    if len(place.hosts) < layout.nodes:
        raise UserError(f"SLURM_JOB_NODELIST has {len(place.hosts)} hosts, but the recipe lays out {layout.nodes} "
                        "nodes: submit the job with the #SBATCH --nodes `rlrecipe slurm` wrote")
    role = layout.role(place.node)
    console.print(f"node {place.node} of {layout.nodes} ({place.hosts[place.node]}): {role}", highlight=False)
    if role == ROLLOUT:  # become rollout-servers: the job's signals reach it, and it cleans up before exiting
        cmd = rollout_command(loaded, overrides, layout, place)
        sys.stdout.flush()
        os.execv(cmd[0], cmd)
    servers = None
    if role == BOTH:
        servers = subprocess.Popen(rollout_command(loaded, overrides, layout, place))
    try:
        urls = None
        if layout.serves:
            wait_s = recipe.rollout.sglang.startup_timeout_s + URLS_GRACE_S
            urls = wait_for_urls(urls_path(loaded), recipe.rollout.sglang.num_servers, wait_s)
        node_env = {**env, "RLRECIPE_NODE_RANK": str(place.node)}
        return subprocess.call(trainer_command(loaded, stage, overrides, place, urls, resume), env=node_env)
    finally:
        if servers is not None and servers.poll() is None:
            servers.send_signal(signal.SIGTERM)  # it stops its servers and takes its URLs out of the list
            servers.wait(timeout=120)

