"""`rlrecipe data ...`: download, import, validate, make synthetic tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Datasets: pinned downloads, imports, validation, synthetic tasks.")


@app.command()
def make(name: Annotated[str, typer.Argument(help="synthetic task: tiny-arith")],
         out: Annotated[Path, typer.Option(help="output directory")] = Path("data/tiny-arith"),
         seed: Annotated[int, typer.Option()] = 0,
         n_sft: Annotated[int, typer.Option(help="SFT examples")] = 4000,
         n_rl: Annotated[int, typer.Option(help="RL prompts")] = 4000,
         n_eval: Annotated[int, typer.Option(help="held-out problems")] = 200,
         forget_prob: Annotated[float, typer.Option(help="teacher's chance to drop a carry of 10 or 11")] = 0.6,
         ) -> None:
    """Write a deterministic synthetic task (sft.jsonl, rl.jsonl, eval.jsonl)."""
    from rlrecipe.data.tiny_arith import TinyArithConfig, write_tiny_arith

    cfg = TinyArithConfig(seed=seed, n_sft=n_sft, n_rl=n_rl, n_eval=n_eval, forget_prob=forget_prob)
    if name != "tiny-arith":
        from rlrecipe.errors import UserError

        raise UserError(f"unknown synthetic task {name!r}; available: tiny-arith")
    stats = write_tiny_arith(out, cfg)
    for key, value in stats.items():
        typer.echo(f"{key}: {value}")
