"""`rlrecipe plan RECIPE`: the per-GPU memory budget of a recipe, before a long job starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError


def plan(recipes: Annotated[list[Path], typer.Argument(help="recipe YAML files")],
         set_: Annotated[list[str] | None, typer.Option("--set", help="dotted override, e.g. trainer.nproc=4")] = None,
         ) -> None:
    """Print each recipe's expected peak memory per GPU (training and rollout); refuse one that cannot fit."""
    from rlrecipe.checks.host_disk import footprint
    from rlrecipe.checks.model_dims import GIB
    from rlrecipe.checks.plan import plan as make_plan
    from rlrecipe.recipe.schema import load_recipe

    refused = []
    for path in recipes:
        loaded = load_recipe(path, set_ or [])
        dims, stage, budgets = make_plan(loaded)
        table = Table(title=f"{path} ({stage}): {dims.params() / 1e9:.3g}B parameters, V = {dims.vocab}, "
                            f"{dims.layers} layers, hidden {dims.hidden}", title_justify="left")
        table.add_column("side")
        table.add_column("component")
        table.add_column("GiB per GPU", justify="right")
        for b in budgets:
            for name, value in b.parts.items():
                table.add_row(b.side, name, f"{value / GIB:.2f}")
            verdict = "fits" if b.fits else "[red]does not fit[/]"
            table.add_row(b.side, f"[bold]total[/] (of {b.capacity / GIB:.1f})", f"[bold]{b.total / GIB:.2f}[/] {verdict}")
        console.print(table)
        for b in budgets:
            for note in b.notes:
                console.print(f"  {b.side}: {note}", highlight=False)
        outside = footprint(loaded.recipe, dims)
        for label, parts in (("rank-0 host memory", outside.host), ("run directory on disk", outside.disk)):
            if parts:
                detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
                console.print(f"  {label}: {sum(parts.values()) / GIB:.1f} GiB ({detail})", highlight=False)
        refused += [f"{path}: {b.side} side needs {b.total / GIB:.1f} GiB per GPU, has {b.capacity / GIB:.1f}"
                     + ("" if b.room_for_one_sequence else " (no room for one full-length sequence)")
                     for b in budgets if not b.fits]
    if refused:
        raise UserError("will not fit: " + "; ".join(refused))
