"""`rlrecipe`: one thin typer command per stage; the work lives in the library."""

from __future__ import annotations

import sys

import typer
from rlrecipe.cli import cluster as cluster_cmd
from rlrecipe.cli import data as data_cmd
from rlrecipe.cli import doctor as doctor_cmd
from rlrecipe.cli import fit as fit_cmd
from rlrecipe.cli import grade as grade_cmd
from rlrecipe.cli import plan as plan_cmd
from rlrecipe.cli import servers as servers_cmd
from rlrecipe.cli import stages

from rlrecipe.core.console import console
from rlrecipe.core.dist import is_launched_rank
from rlrecipe.core.errors import UserError
from rlrecipe.train.launch import end_process

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Reproducible RL-from-verifiable-rewards recipes: data -> sft -> rl -> eval.")
app.add_typer(data_cmd.app, name="data")
stages.register(app)
app.command()(plan_cmd.plan)
app.command()(doctor_cmd.doctor)
app.command()(fit_cmd.fit)
app.command()(grade_cmd.grade)
app.command(name="rollout-servers")(servers_cmd.rollout_servers)
app.command()(cluster_cmd.slurm)
app.command(name="cluster-node")(cluster_cmd.cluster_node)


def main() -> None:
    try:
        app()
        code = 0
    except UserError as err:
        console.print(f"[red]error:[/] {err}", highlight=False, soft_wrap=True)
        code = err.exit_code
    except SystemExit as done:  # typer ends every command this way
        code = done.code
    if is_launched_rank():
        end_process(code)  # see there: skips the interpreter teardown a rank can abort in
    sys.exit(code)


if __name__ == "__main__":
    main()
