"""`rlrecipe rollout-servers RECIPE --node N`: this node's share of the recipe's SGLang servers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def rollout_servers(
        recipe: Annotated[Path, typer.Argument(help="recipe YAML (rollout.sglang: num_servers, nodes, tp/dp)")],
        node: Annotated[int, typer.Option(help="this node's number among rollout.sglang.nodes (0-based)")],
        gpus: Annotated[int | None, typer.Option(min=0, help="GPUs this node has for the servers; default: the "
                                                             "GPUs visible here (not checked with a launch_cmd "
                                                             "or --dry-run)")] = None,
        url_host: Annotated[str | None, typer.Option(help="this node's address in the URLs; default: "
                                                          "rollout.sglang.host, or the hostname when that is "
                                                          "0.0.0.0")] = None,
        urls_out: Annotated[Path | None, typer.Option(help="merge this node's URLs into this YAML list (one file "
                                                           "for all nodes, locked while written)")] = None,
        log_dir: Annotated[Path | None, typer.Option(help="server logs; default: a new temporary directory")] = None,
        dry_run: Annotated[bool, typer.Option(help="print the commands and URLs, start nothing")] = False,
        set_: Annotated[list[str] | None, typer.Option("--set", help="dotted override, e.g. "
                                                                     "rollout.sglang.host=0.0.0.0")] = None,
) -> None:
    """Start node N's share of rollout.sglang.num_servers, print their URLs once healthy, serve until Ctrl-C."""
    from rlrecipe.recipe.schema import load_recipe
    from rlrecipe.rollout.sglang.node_servers import run_node

    loaded = load_recipe(recipe, set_ or [])
    run_node(loaded, node, gpus=gpus, url_host=url_host, urls_out=urls_out, log_dir=log_dir, dry_run=dry_run,
             out=typer.echo)
