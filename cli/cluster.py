"""`rlrecipe slurm` (a batch script for a recipe's layout) and `rlrecipe cluster-node` (what the script
runs on each node)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

SETS = typer.Option("--set", help="dotted override, passed on to every node")


def slurm(recipe: Annotated[Path, typer.Argument(help="recipe YAML, laid out for the cluster (rlrecipe fit --out)")],
          out: Annotated[Path | None, typer.Option(help="write the script here (default: print it)")] = None,
          gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs on each node")] = 8,
          stage: Annotated[str, typer.Option(help="rl or sft")] = "rl",
          nodes: Annotated[int | None, typer.Option(min=1, help="nodes you have: refused if the layout needs "
                                                                "more")] = None,
          partition: Annotated[str | None, typer.Option()] = None,
          account: Annotated[str | None, typer.Option()] = None,
          time: Annotated[str | None, typer.Option(help="the job's time limit, as sbatch --time")] = None,
          assume_shared: Annotated[bool, typer.Option(help="run.output_dir is on a filesystem every node "
                                                           "mounts, though it looks local here")] = False,
          retries: Annotated[int, typer.Option(min=0, max=9, help="a failed training step runs again with --resume "
                                                                  "in the same allocation, this many times")] = 3,
          set_: Annotated[list[str] | None, SETS] = None) -> None:
    """A Slurm batch script that starts every node of the recipe's layout: one srun per role."""
    from rlrecipe.cluster.sbatch import SlurmOptions, render
    from rlrecipe.core.errors import UserError
    from rlrecipe.recipe.schema import load_recipe

    if stage not in ("rl", "sft"):
        raise UserError(f"--stage {stage!r}: rl or sft")
    loaded = load_recipe(recipe, set_ or [])
    text = render(loaded, set_ or [], SlurmOptions(gpus_per_node=gpus_per_node, stage=stage, nodes=nodes,
                                                   partition=partition, account=account, time=time,
                                                   assume_shared=assume_shared, retries=retries))
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        out.chmod(0o755)
        typer.echo(f"wrote {out}: submit with `sbatch {out}`, resume with `sbatch {out} --resume`")


def cluster_node(recipe: Annotated[Path, typer.Argument(help="recipe YAML")],
                 stage: Annotated[str, typer.Option(help="rl or sft")] = "rl",
                 gpus_per_node: Annotated[int, typer.Option(min=1)] = 8,
                 resume: Annotated[bool, typer.Option("--resume", help="continue from the last checkpoint")] = False,
                 set_: Annotated[list[str] | None, SETS] = None) -> None:
    """This node's part of a Slurm job (SLURMD_NODENAME in SLURM_JOB_NODELIST): train, serve, or both."""
    from rlrecipe.cluster.node import run_node
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe, set_ or [])
    raise typer.Exit(run_node(loaded, set_ or [], stage=stage, gpus_per_node=gpus_per_node, resume=resume))
