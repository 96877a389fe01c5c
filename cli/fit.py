"""`rlrecipe fit RECIPE --gpus N`: the recipe laid out on these GPUs, ranked (rlrecipe/checks/fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError

SHOWN = 5


def fit(recipe: Annotated[Path, typer.Argument(help="recipe YAML to lay out")],
        gpus: Annotated[int, typer.Option(help="GPUs per node")],
        nodes: Annotated[int, typer.Option(help="nodes")] = 1,
        gpu_memory: Annotated[float, typer.Option("--gpu-memory", help="memory of one GPU, GiB")] = 80.0,
        host_memory: Annotated[float | None, typer.Option("--host-memory",
                                                          help="memory of one node, GiB (unchecked if left out)")] = None,
        out: Annotated[Path | None, typer.Option(help="write the best layout as a recipe here")] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", help="dotted override of the source recipe")] = None,
        ) -> None:
    """Lay a recipe out on these GPUs without changing what it trains: the layouts `rlrecipe plan` says
    fit, fastest first; --out writes the best as a recipe that says what changed and why."""
    from rlrecipe.checks.fit import fit as fit_layouts
    from rlrecipe.checks.fit_layout import check_machine
    from rlrecipe.checks.fit_recipe import write_fitted
    from rlrecipe.checks.fit_search import FIT_MARGIN
    from rlrecipe.checks.model_dims import GIB
    from rlrecipe.recipe.schema import load_recipe

    machine = check_machine(gpus, nodes, gpu_memory, host_memory)
    loaded = load_recipe(recipe, set_ or [])
    result = fit_layouts(loaded, machine)
    if result.refusal:
        raise UserError(result.refusal)
    count = len(result.layouts)
    table = Table(title=f"{recipe} on {machine.label}: {count} layout{' fits' if count == 1 else 's fit'} "
                        f"({FIT_MARGIN:.0%} of each GPU kept free), fastest first", title_justify="left")
    for col in ("#", "GPUs t+r", "training", "rollout", "GiB/GPU t|r", "host GiB", "s: roll|train",
                "step s", "s/1M tok", f"h/{loaded.recipe.rl.steps}"):
        table.add_column(col, justify="left" if col in ("training", "rollout", "GPUs t+r") else "right")
    for i, lay in enumerate(result.layouts[:SHOWN], 1):
        t, r = lay.train, lay.rollout
        table.add_row(str(i), lay.split, t.label, r.label, f"{t.peak / GIB:.1f}|{r.pool / GIB:.1f}",
                      f"{t.host / GIB:.0f}", f"{r.time.seconds:.0f}|{t.time.seconds:.0f}", f"{lay.step_s:.0f}",
                      f"{lay.s_per_mtoken:.1f}", f"{lay.hours:.0f}")
    console.print(table)
    console.print("  training: Z<ZeRO stage>, +o optimizer / +p parameters offloaded, micro-batch tokens x "
                  "micro-batches per rank per PPO minibatch (the gradient accumulation), c<log-prob chunk>; "
                  "rollout: SGLang servers x tensor parallel @ memory fraction; host: node 0 at worst; "
                  "times projected at H100 rates (docs/gpu.md)", highlight=False)
    if out is None:
        console.print("  --out FILE writes the first as a recipe", highlight=False)
        return
    fitted = write_fitted(result, out)
    console.print(f"wrote {out}: sha256 {fitted.sha256()}, algorithm sha256 {fitted.algorithm_sha256()} "
                  "(the source's)", highlight=False, soft_wrap=True)
