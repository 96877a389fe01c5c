"""`rlrecipe results`: print the recorded evaluation results and regenerate RESULTS.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rlrecipe.eval.report import (
    ASYNC_STUDY_FILE,
    CONSOLE_HEADER,
    STUDY_FILE,
    all_results,
    collect_results,
    console_rows,
    load_study,
    public_record,
    write_results_md,
)
from rlrecipe.eval.results_store import (
    ASYNC_STUDY,
    STORE,
    STUDY,
    load_records,
    pending,
    save_record,
    save_study,
)

from rlrecipe.core.console import console as err_console
from rlrecipe.core.errors import UserError


def record_local(runs_dir: str | Path = "runs", store: str | Path = STORE) -> int:
    """Keep every local result (and a local mismatch study) in the store, replacing the stored one of
    the same recipe, model and benchmark; how many results were written."""
    local = collect_results(runs_dir)
    for r in local:
        err_console.print(f"kept {save_record(r, store)}", highlight=False)
    for study_file, kept in ((STUDY_FILE, STUDY), (ASYNC_STUDY_FILE, ASYNC_STUDY)):
        study = load_study(runs_dir, study_file)
        if study:
            err_console.print(f"kept {save_study(study, store, kept)}", highlight=False)
    return len(local)


def results_command(as_json: bool = False, write: bool = True, runs_dir: str | Path = "runs",
                    path: str | Path = "RESULTS.md", record: bool = False,
                    store: str | Path = STORE) -> list[dict[str, Any]]:
    """Print the results (rich table or JSON list) and regenerate RESULTS.md; `record` first keeps
    the local runs' results in the store."""
    from rich.console import Console
    from rich.table import Table

    if record:
        record_local(runs_dir, store)
    else:
        for r in pending(load_records(store), collect_results(runs_dir)):
            err_console.print(f"{r['summary_path']}: differs from the kept result of {r['recipe']} on "
                              f"{r['benchmark']}, which RESULTS.md keeps showing; `rlrecipe results --record` "
                              "replaces it", highlight=False, soft_wrap=True)
    results = all_results(runs_dir, store)
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
        out.print(f"no results kept in {store}/ or under {runs_dir}/ yet (run `rlrecipe eval <recipe>`)",
                  highlight=False)
        return results
    table = Table(*CONSOLE_HEADER, title="Recorded results (percent)")
    for row in console_rows(results):
        table.add_row(*row)
    out.print(table)
    return results
