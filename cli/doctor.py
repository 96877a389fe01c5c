"""`rlrecipe doctor [RECIPE]`: this machine against what a recipe needs, one table (rlrecipe/checks/doctor.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError


def doctor(recipe: Annotated[Path | None, typer.Argument(help="recipe YAML; without it, what the machine has")] = None,
           set_: Annotated[list[str] | None, typer.Option("--set", help="dotted override, e.g. trainer.nproc=4")] = None,
           ) -> None:
    """Check versions, GPUs, attention, SGLang, DeepSpeed, the model, disk, host memory and the output
    directory against the recipe; exit 1 if any check fails."""
    from rlrecipe.checks.check import FAIL, OK
    from rlrecipe.checks.doctor import run_checks
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe, set_ or []) if recipe is not None else None
    rows = run_checks(loaded)
    table = Table(title=f"rlrecipe doctor: {recipe if recipe else 'this machine'}", title_justify="left")
    for col in ("check", "need", "have", "status"):
        table.add_column(col, overflow="fold")
    for c in rows:
        colour = "green" if c.status == OK else "red" if c.status == FAIL else "yellow"
        table.add_row(c.name, c.need, c.have, f"[{colour}]{c.status}[/]" + (" (stops a run)" if c.fatal and c.status == FAIL else ""))
    console.print(table)
    failed = [c.name for c in rows if c.status == FAIL]
    if failed:
        raise ChecksFailed(f"{len(failed)} check(s) failed: {', '.join(failed)}")


class ChecksFailed(UserError):
    exit_code = 1
