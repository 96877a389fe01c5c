"""`rlrecipe slurm RECIPE`: the Slurm batch script that runs a recipe's layout (cluster/layout.py).

- **`#SBATCH` lines.** The nodes and GPUs come from the recipe, with one task per node.
- **Rendezvous.** The port is chosen free on the first node, where the script runs.
- **The job.** It forgets the last job's server list, then starts one `srun` per role, each running
  `rlrecipe cluster-node` on its nodes. Its exit status is the training step's, and the rollout
  step is stopped once training ends.
- **Resuming.** `sbatch job.sbatch --resume` passes `--resume` on to every node.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.checks.check import SHARED_FS
from rlrecipe.checks.host_checks import filesystem_type
from rlrecipe.cluster.layout import JobLayout, job_layout
from rlrecipe.cluster.node import PORT_ENV, URLS_FILE
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe

FREE_PORT = "python3 -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])'"


@dataclass(frozen=True)
class SlurmOptions:
    gpus_per_node: int = 8
    stage: str = "rl"
    nodes: int | None = None  # what the user has: refused when the layout needs more
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    assume_shared: bool = False  # run.output_dir is shared though its filesystem looks local


def check_shared_output(loaded: LoadedRecipe, layout: JobLayout, assume_shared: bool) -> None:
    out = Path(loaded.recipe.run.output_dir)
    kind = filesystem_type(out)
    if layout.nodes > 1 and not assume_shared and kind is not None and kind not in SHARED_FS \
            and not kind.startswith("fuse"):
        raise UserError(f"run.output_dir {out} lies on a local {kind} filesystem here, but the {layout.nodes} nodes "
                        "share checkpoints and the server list through it: set it to a shared path (or pass "
                        "--assume-shared if every node mounts it)")


def _sbatch_lines(loaded: LoadedRecipe, layout: JobLayout, opt: SlurmOptions) -> list[str]:
    recipe = loaded.recipe
    lines = [f"#SBATCH --job-name={recipe.run.name}", f"#SBATCH --nodes={layout.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={opt.gpus_per_node}",
             "#SBATCH --exclusive", "#SBATCH --output=%x-%j.out"]  # Slurm opens it before any directory is made
    for flag, value in (("partition", opt.partition), ("account", opt.account), ("time", opt.time)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def _describe(loaded: LoadedRecipe, layout: JobLayout) -> str:
    tr = loaded.recipe.trainer
    train = f"{layout.train_nodes} training node(s) of {tr.nproc} rank(s)"
    if layout.colocated_nodes:
        return f"{train}, each also serving {layout.servers_per_node} SGLang server(s) on the same GPUs"
    if layout.rollout_nodes:
        return f"{train}, then {layout.rollout_nodes} rollout node(s) of {layout.servers_per_node} SGLang server(s)"
    ro = loaded.recipe.rollout
    if ro.engine == "sglang" and not ro.urls:
        where = "on the same GPUs (colocated)" if ro.colocate else "beside training"
        return f"{train}; the run launches its {ro.sglang.num_servers} SGLang server(s) there, {where}"
    return train


def render(loaded: LoadedRecipe, overrides: list[str], opt: SlurmOptions) -> str:
    layout = job_layout(loaded.recipe, opt.gpus_per_node, serving=opt.stage == "rl")
    if opt.nodes is not None and layout.nodes > opt.nodes:
        raise UserError(f"{loaded.path}: the layout needs {layout.nodes} nodes ({_describe(loaded, layout)}), but "
                        f"--nodes is {opt.nodes}: lay the recipe out for them first (`rlrecipe fit ... --nodes "
                        f"{opt.nodes} --out FILE`)")
    check_shared_output(loaded, layout, opt.assume_shared)
    node_args = ["cluster-node", str(loaded.path), "--stage", opt.stage, "--gpus-per-node", str(opt.gpus_per_node),
                 *[x for s in overrides for x in ("--set", s)]]
    run = f"${{RLRECIPE:-rlrecipe}} {shlex.join(node_args)} \"$@\""
    out = ["#!/bin/bash",
           f"# {loaded.path} (sha256 {loaded.sha256[:12]}): {_describe(loaded, layout)}.",
           "# Written by `rlrecipe slurm`; submit with `sbatch FILE`, resume with `sbatch FILE --resume`.",
           *_sbatch_lines(loaded, layout, opt),
           "set -uo pipefail",
           "# the trainer's rendezvous: the first node (this one) at a port free here",
           f"export {PORT_ENV}=\"$({FREE_PORT})\"",
           f"rm -f {shlex.quote(str(loaded.recipe.run.dir / URLS_FILE))}  # the last job's servers are gone"]
    if layout.rollout_nodes:
        out += [f"srun --nodes={layout.rollout_nodes} --ntasks={layout.rollout_nodes} --relative={layout.train_nodes} "
                f"--kill-on-bad-exit=0 {run} &",
                "servers=$!"]
    out += [f"srun --nodes={layout.train_nodes} --ntasks={layout.train_nodes} --relative=0 {run}",
            "rc=$?"]
    if layout.rollout_nodes:
        out += ["kill \"$servers\" 2>/dev/null; wait \"$servers\" 2>/dev/null",]
    out += ["exit $rc", ""]
    return "\n".join(out)
