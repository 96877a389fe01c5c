"""`rlrecipe data ...`: download, import, validate, make synthetic tasks."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from rlrecipe.data.registry import DATA_DIR

app = typer.Typer(no_args_is_help=True, help="Datasets: pinned downloads, imports, validation, synthetic tasks.")


@app.command()
def make(name: Annotated[str, typer.Argument(help="synthetic task: tiny-arith")],
         out: Annotated[Path, typer.Option(help="output directory")] = Path("data/tiny-arith"),
         seed: Annotated[int, typer.Option()] = 0,
         n_sft: Annotated[int, typer.Option(help="SFT examples", min=1)] = 20000,
         n_rl: Annotated[int, typer.Option(help="RL prompts", min=1)] = 4000,
         n_eval: Annotated[int, typer.Option(help="held-out problems", min=1)] = 200,
         forget_prob: Annotated[float, typer.Option(help="teacher's chance to forget a carry when units sum to 10 or 11",
                                                    min=0.0, max=1.0)] = 0.8,
         ) -> None:
    """Write a deterministic synthetic task (sft.jsonl, rl.jsonl, eval.jsonl)."""
    from rlrecipe.data.tiny_arith import TinyArithConfig, write_tiny_arith

    cfg = TinyArithConfig(seed=seed, n_sft=n_sft, n_rl=n_rl, n_eval=n_eval, forget_prob=forget_prob)
    if name != "tiny-arith":
        from rlrecipe.core.errors import UserError

        raise UserError(f"unknown synthetic task {name!r}; available: tiny-arith")
    try:
        stats = write_tiny_arith(out, cfg)
    except OSError as err:
        from rlrecipe.core.errors import UserError

        raise UserError(f"--out {out}: cannot write there ({err.strerror or err})") from None
    for key, value in stats.items():
        typer.echo(f"{key}: {value}")


class Kind(StrEnum):
    rl = "rl"
    sft = "sft"
    eval = "eval"


@app.command()
def download(name: Annotated[str, typer.Argument(help="registered dataset (see data/registry.yaml)")],
             revision: Annotated[str | None, typer.Option(help="hub revision; default: the registry's pin")] = None,
             dest: Annotated[Path, typer.Option(help="data directory; writes DEST/NAME/KIND.jsonl")] = DATA_DIR,
             ) -> None:
    """Download a registered dataset at its pinned revision, verify its sha256, convert it to JSONL."""
    from rlrecipe.data.download import download as run_download

    result = run_download(name, revision=revision, dest=dest)
    for line in result.summary_lines():
        typer.echo(line)


@app.command("import")
def import_(file: Annotated[Path, typer.Argument(help="local raw file: .jsonl, .json or .parquet")],
            as_: Annotated[str, typer.Option("--as", help="dataset name (a registry name, or a new one)")],
            kind: Annotated[Kind | None, typer.Option(help="rl | sft | eval (default: the registry's)")] = None,
            dest: Annotated[Path, typer.Option(help="data directory; writes DEST/NAME/KIND.jsonl")] = DATA_DIR,
            ) -> None:
    """Convert a file obtained elsewhere, with the same conversion and checksum checks as download."""
    from rlrecipe.data.download import import_file

    result = import_file(file, as_, kind=kind.value if kind else None, dest=dest)
    for line in result.summary_lines():
        typer.echo(line)


@app.command()
def validate(file: Annotated[Path, typer.Argument(help="canonical JSONL file")],
             kind: Annotated[Kind, typer.Option(help="rl | sft | eval")],
             ) -> None:
    """Check a canonical JSONL file: one error naming the line, or row and duplicate counts."""
    from rlrecipe.data.validate import validate_file

    for line in validate_file(file, kind.value).summary_lines():
        typer.echo(line)
