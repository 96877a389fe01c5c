"""`rlrecipe results`: print the recorded evaluation results and regenerate RESULTS.md."""

from __future__ import annotations

import json
import sys

from rlrecipe.eval.recording import refresh_results
from rlrecipe.eval.report import CONSOLE_HEADER, console_rows, public_record
from rlrecipe.eval.results_store import STORE


def results_command(as_json: bool = False, write: bool = True, record: bool = False) -> None:
    """Print the results (rich table or JSON list) after regenerating RESULTS.md; `record` first keeps
    the local runs' results in the store."""
    from rich.console import Console
    from rich.table import Table

    results = refresh_results("runs", STORE, "RESULTS.md" if write else None, record=record)
    if as_json:
        sys.stdout.write(json.dumps([public_record(r) for r in results], indent=2) + "\n")
        return
    out = Console() if sys.stdout.isatty() else Console(width=200)
    if not results:
        out.print(f"no results kept in {STORE}/ or under runs/ yet (run `rlrecipe eval <recipe>`)", highlight=False)
        return
    table = Table(*CONSOLE_HEADER, title="Recorded results (percent)")
    for row in console_rows(results):
        table.add_row(*row)
    out.print(table)
