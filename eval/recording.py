"""Keeping results: local runs' results copied into the store (`results/`, kept in git), and
RESULTS.md regenerated from the store and the local runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlrecipe.eval.report import (
    ASYNC_STUDY_FILE,
    OPTIONS_STUDY_FILE,
    STUDY_FILE,
    all_results,
    collect_results,
    load_study,
    write_results_md,
)
from rlrecipe.eval.results_store import (
    ASYNC_STUDY,
    OPTIONS_STUDY,
    STORE,
    STUDY,
    load_records,
    pending,
    save_record,
    save_study,
)

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError


def record_local(runs_dir: str | Path = "runs", store: str | Path = STORE) -> int:
    """Keep every local result (and a local study) in the store, replacing the stored one of the same
    recipe, model and benchmark; how many results were written."""
    local = collect_results(runs_dir)
    for r in local:
        console.print(f"kept {save_record(r, store)}", highlight=False)
    for study_file, kept in ((STUDY_FILE, STUDY), (ASYNC_STUDY_FILE, ASYNC_STUDY), (OPTIONS_STUDY_FILE, OPTIONS_STUDY)):
        study = load_study(runs_dir, study_file)
        if study:
            console.print(f"kept {save_study(study, store, kept)}", highlight=False)
    return len(local)


def refresh_results(runs_dir: str | Path = "runs", store: str | Path = STORE, path: str | Path | None = "RESULTS.md",
                    record: bool = False) -> list[dict[str, Any]]:
    """Every result, kept ones first; `record` keeps the local runs' results first (otherwise a local
    result that differs from a kept one is named); `path` is the RESULTS.md to regenerate, or None."""
    if record:
        record_local(runs_dir, store)
    else:
        for r in pending(load_records(store), collect_results(runs_dir)):
            console.print(f"{r['summary_path']}: differs from the kept result of {r['recipe']} on "
                          f"{r['benchmark']}, which RESULTS.md keeps showing; `rlrecipe results --record` "
                          "replaces it", highlight=False, soft_wrap=True)
    results = all_results(runs_dir, store)
    if path is not None:
        try:
            written = write_results_md(path, results)
        except OSError as err:
            raise UserError(f"{path}: cannot write: {err}") from None
        console.print(f"wrote {written} ({len(results)} result(s))", highlight=False)
    return results
