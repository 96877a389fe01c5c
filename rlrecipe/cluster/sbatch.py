"""`rlrecipe slurm RECIPE`: the Slurm batch script that runs a recipe's layout (cluster/layout.py).

- **`#SBATCH` lines.** The nodes and GPUs come from the recipe, with one task per node, whole
  nodes, and `--requeue`: a job Slurm puts back in the queue (a node lost) resumes by itself.
- **Rendezvous.** The port is drawn from the job's id below the ephemeral range, so every node
  knows it without asking and no outgoing connection can hold it; nothing but bash runs on the batch host.
- **The job.** It forgets the last job's server list, then starts one `srun` per role, each step
  given its nodes whole (`--whole`: a step is otherwise held to one task's CPUs on some Slurm
  versions, while torchrun starts a rank per GPU) and each running `rlrecipe cluster-node`. Its
  exit status is the training step's, and the rollout step is stopped once training ends.
- **Trying again.** A training step that failed for anything but a mistake in the recipe (exit 2)
  runs again with `--resume` in the same allocation, up to `retries` times, on a new port.
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

PORT_BASE = 20000  # up to PORT_BASE + 10000, below Linux's ephemeral range (32768 on)
RECIPE_ERROR = 2  # UserError's exit status: running again would fail the same way
ROLLOUT_STEP = "rollout-servers"  # the rollout step's name, by which the script signals it
STOP_WAIT_S = 60  # for rollout-servers to stop its servers and take them out of the list
# A signal to srun ends its step by force (SIGKILL after KillWait): the servers would stay listed.
# scancel --signal reaches every task of the step instead, and each stops in its own time.
STOP_STEP = f"""stop_step() {{  # NAME SRUN_PID: SIGTERM to the tasks of the job's step NAME, then wait for its srun
    local step
    step="$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' | awk -v name="$1" '$2 == name {{print $1}}')"
    # 22.05's scancel signals the step, then says "Invalid job id" of it: its word is not the step's
    [ -n "$step" ] && scancel --quiet --signal=TERM "$step" 2>/dev/null
    for _ in $(seq {STOP_WAIT_S * 2}); do kill -0 "$2" 2>/dev/null || break; sleep 0.5; done
    kill "$2" 2>/dev/null; wait "$2" 2>/dev/null
}}"""


@dataclass(frozen=True)
class SlurmOptions:
    gpus_per_node: int = 8
    stage: str = "rl"
    nodes: int | None = None  # what the user has: refused when the layout needs more
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    assume_shared: bool = False  # run.output_dir is shared though its filesystem looks local
    retries: int = 3  # a failed training step run again with --resume in the same allocation


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
             "#SBATCH --exclusive", "#SBATCH --requeue",
             "#SBATCH --open-mode=append",  # a requeued job's output follows the first's
             "#SBATCH --output=%x-%j.out"]  # Slurm opens it before any directory is made
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


def _port_expr(retries: int) -> str:
    """The rendezvous port of try $try: distinct for each try of a job and for jobs close in id."""
    slots = retries + 1
    return f"$(({PORT_BASE} + (SLURM_JOB_ID % {10000 // slots}) * {slots} + try))"


def _steps(layout: JobLayout, run: str) -> list[str]:
    """One try: the rollout step in the background, the training step in the foreground."""
    step = "srun --whole --ntasks-per-node=1"
    out = []
    if layout.rollout_nodes:
        out += [f"    {step} --job-name={ROLLOUT_STEP} --nodes={layout.rollout_nodes} --ntasks={layout.rollout_nodes} "
                f"--relative={layout.train_nodes} --kill-on-bad-exit=0 {run} &",
                "    servers=$!"]
    out += [f"    {step} --nodes={layout.train_nodes} --ntasks={layout.train_nodes} --relative=0 "
            f"--kill-on-bad-exit=1 {run}",
            "    rc=$?"]
    if layout.rollout_nodes:
        out += [f"    stop_step {ROLLOUT_STEP} \"$servers\""]
    return out


def render(loaded: LoadedRecipe, overrides: list[str], opt: SlurmOptions) -> str:
    layout = job_layout(loaded.recipe, opt.gpus_per_node, serving=opt.stage == "rl")
    if opt.nodes is not None and layout.nodes > opt.nodes:
        raise UserError(f"{loaded.path}: the layout needs {layout.nodes} nodes ({_describe(loaded, layout)}), but "
                        f"--nodes is {opt.nodes}: lay the recipe out for them first (`rlrecipe fit ... --nodes "
                        f"{opt.nodes} --out FILE`)")
    if not 0 <= opt.retries <= 9:
        raise UserError(f"--retries {opt.retries}: 0 to 9")
    check_shared_output(loaded, layout, opt.assume_shared)
    node_args = ["cluster-node", str(loaded.path), "--stage", opt.stage, "--gpus-per-node", str(opt.gpus_per_node),
                 *[x for s in overrides for x in ("--set", s)]]
    run = f"${{RLRECIPE:-rlrecipe}} {shlex.join(node_args)} \"${{args[@]}}\""
    out = ["#!/bin/bash",
           f"# {loaded.path} (sha256 {loaded.sha256[:12]}): {_describe(loaded, layout)}.",
           "# Written by `rlrecipe slurm`; submit with `sbatch FILE`, resume with `sbatch FILE --resume`.",
           *_sbatch_lines(loaded, layout, opt),
           "set -uo pipefail",
           *([STOP_STEP] if layout.rollout_nodes else []),
           "args=(\"$@\")",
           "# requeued by Slurm (a node lost): continue from the last checkpoint",
           "[ \"${SLURM_RESTART_COUNT:-0}\" -gt 0 ] && args+=(--resume)",
           f"for try in $(seq 0 {opt.retries}); do",
           "    # the trainers' rendezvous on the first node: a port drawn from the job's id, new for each try",
           f"    export {PORT_ENV}=\"{_port_expr(opt.retries)}\"",
           f"    rm -f {shlex.quote(str(loaded.recipe.run.dir / URLS_FILE))}  # the last try's servers are gone",
           *_steps(layout, run),
           f"    # done, or a mistake in the recipe ({RECIPE_ERROR}) that another try would repeat",
           f"    [ $rc -eq 0 ] || [ $rc -eq {RECIPE_ERROR} ] || [ $try -eq {opt.retries} ] && break",
           "    echo \"training step exited $rc: running it again with --resume ($((try + 1)) of "
           f"{opt.retries})\" >&2",
           "    args+=(--resume)",
           "done",
           "exit $rc", ""]
    return "\n".join(out)
