"""`rlrecipe results`: print the recorded evaluation results and regenerate RESULTS.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rlrecipe.eval.report import (
    CONSOLE_HEADER,
    collect_results,
    console_rows,
    public_record,
    write_results_md,
)

from rlrecipe.console import console as err_console
from rlrecipe.errors import UserError


def results_command(as_json: bool = False, write: bool = True, runs_dir: str | Path = "runs",
                    path: str | Path = "RESULTS.md") -> list[dict[str, Any]]:
    """Print the recorded results (rich table or JSON list) and regenerate RESULTS.md."""
    from rich.console import Console
    from rich.table import Table

    results = collect_results(runs_dir)
    if write:
        try:
            written = write_results_md(path, results)
        except OSError as err:
            raise UserError(f"{path}: cannot write: {err}") from None
        err_console.print(f"wrote {written} ({len(results)} result(s))", highlight=False)
    if as_json:
        sys.stdout.write(json.dumps([public_record(r) for r in results], indent=2) + "\n")
        return results
    out = Console() if sys.stdout.isatty() else Console(width=200)
    if not results:
        out.print(f"no results recorded yet under {runs_dir}/ (run `rlrecipe eval <recipe>`)", highlight=False)
        return results
    table = Table(*CONSOLE_HEADER, title="Recorded results (percent)")
    for row in console_rows(results):
        table.add_row(*row)
    out.print(table)
    return results
