"""The evaluation stage: a recipe's model (or the latest run's) on its benchmarks, recorded in the run
(`eval/` beside the training records) and in RESULTS.md."""

from __future__ import annotations

import json
from pathlib import Path

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.eval.report import write_results_md
from rlrecipe.eval.runner import evaluate_model_dir
from rlrecipe.modeling import hub_snapshot, model_record
from rlrecipe.recipe.schema import LoadedRecipe, load_recipe
from rlrecipe.run.env import record_model
from rlrecipe.run.record import Run, latest_run


def run_eval(recipe_path: Path | None, model: str | None, overrides: list[str]) -> dict[str, dict]:
    """avg@n, its stderr and pass@k per benchmark; `recipe_path` None evaluates the latest run with the
    recipe it was started with."""
    if recipe_path is None:
        last = latest_run()
        if last is None:
            raise UserError("no run yet: train first (e.g. `rlrecipe sft recipes/tiny_sft.yaml`) "
                            "or give a recipe: `rlrecipe eval RECIPE --model PATH`")
        console.print(f"evaluating the latest run: {last}")
        # the run's own resolved recipe, reported under the recipe path it was started from
        loaded = load_recipe(last / "recipe.yaml", overrides)
        started_from = json.loads((last / "env.json").read_text()).get("recipe_path")
        if started_from:
            loaded = loaded.model_copy(update={"path": started_from})
    else:
        loaded = load_recipe(recipe_path, overrides)
    from rlrecipe.checks.model_check import check_eval_model

    if model is not None and Path(model).is_dir():  # before the eval records are started
        check_eval_model(loaded, "--model", model)
    run = Run(loaded, "eval", subdir="eval")
    try:  # the eval records are let go however it ends: the next eval finds no stale owner
        model_dir = model_to_evaluate(loaded, run, model)
        if Path(model_dir, "config.json").is_file():
            check_eval_model(loaded, "model", model_dir)
        summaries = evaluate_model_dir(loaded, model_dir, run.dir)
        for name, s in summaries.items():
            run.log(0, {f"{name}/avg": s["avg"], f"{name}/stderr": s["stderr"]}, echo=False)
    finally:
        run.release()
    write_results_md()
    return summaries


def model_to_evaluate(loaded: LoadedRecipe, run: Run, model: str | None) -> Path:
    """--model, else the run's final export, else the recipe's model.path (a hub id at
    model.revision, resolved to its snapshot and recorded as a training start would be)."""
    section = loaded.recipe.model
    if model is not None:
        local = Path(model)
        if local.is_dir():
            return local
        return hub_snapshot(model, section.revision if model == section.path else None)
    final = run.final_model_dir
    if (final / "config.json").exists() or section.path is None:
        return final  # evaluate_model_dir says to train first when it is missing
    path = hub_snapshot(section.path, section.revision)
    record_model(run.dir, model_record(path, section.revision))
    return path
