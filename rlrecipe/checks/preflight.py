"""Checks a training stage makes before it touches its run directory.

A stage that would fail on its model or data must fail before it clears an earlier run's
records, and with one line naming the field and file, not a traceback from deep inside.
"""

from __future__ import annotations

from pathlib import Path

from rlrecipe.checks.model_check import (
    check_eval_context,
    check_model_dir,
    read_model_config,
    templates_need_chat,
)
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.refusals import rl_lora_refusal
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.run.record import resolve_init

TRAIN_DATA = {"sft": "an SFT dataset", "rl": "an RL prompt set"}


def _looks_like_hub_id(value: str) -> bool:
    """`org/name`: a hub repository, resolved (and checked) by transformers when it loads."""
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~"))


def _model_source(loaded: LoadedRecipe, init_from: str | None) -> tuple[str, Path] | None:
    if init_from:
        return "run.init_from", Path(init_from)
    if loaded.recipe.model.path:
        return "model.path", Path(loaded.recipe.model.path)
    return None


def check_model(loaded: LoadedRecipe, init_from: str | None) -> dict | None:
    """The starting model's config: what it says of itself (None for a hub id, checked when loaded).
    `init_from` is `run.init_from` resolved."""
    recipe = loaded.recipe
    source = _model_source(loaded, init_from)
    if source is None:  # built from model.tiny
        return recipe.model.tiny.model_dump() if recipe.model.tiny else None
    field, path = source
    own = recipe.run.dir.resolve()
    if path.resolve() == own or own in path.resolve().parents:
        raise RecipeError(f"{loaded.path}: {field}: {path} lies inside this run's own directory, which the run "
                          "replaces; choose another run.name")
    if field == "model.path" and not path.exists() and _looks_like_hub_id(str(recipe.model.path)):
        return None
    config = read_model_config(field, path)
    check_model_dir(field, path, chat_template=templates_need_chat(recipe, training=True))
    return config


def check_context(loaded: LoadedRecipe, config: dict | None, stage: str) -> None:
    """Generation must fit in the model's context: positions past it are garbage, not an error."""
    recipe = loaded.recipe
    context = (config or {}).get("max_position_embeddings")
    if isinstance(context, int) and recipe.eval.benchmarks:  # the stage ends by evaluating its model
        check_eval_context(loaded, context)
    if not isinstance(context, int) or stage != "rl":
        return
    if recipe.rollout.max_new_tokens >= context:
        raise RecipeError(f"{loaded.path}: rollout.max_new_tokens: {recipe.rollout.max_new_tokens} leaves no room "
                          f"for a prompt in the model's context of {context} tokens")


def require_train_data(loaded: LoadedRecipe, stage: str) -> None:
    if not loaded.recipe.data.train:
        raise UserError(f"{loaded.path}: data.train: {TRAIN_DATA[stage]} is required")


def check_data(loaded: LoadedRecipe, stage: str) -> None:
    from rlrecipe.data.io import load_rows

    train = loaded.recipe.data.train
    rows = load_rows(train, stage)  # names the file and line of the first bad row
    if not rows:
        raise UserError(f"{train}: no rows; the {stage} stage needs at least one")


def check_rollout_servers(loaded: LoadedRecipe, stage: str) -> None:
    """Servers spread over nodes are started there: the run must be told where (before it loads a model)."""
    ro = loaded.recipe.rollout
    if stage == "rl" and ro.engine == "sglang" and ro.sglang.nodes > 1 and not ro.urls:
        raise RecipeError(f"{loaded.path}: rollout.urls: empty, but rollout.sglang.nodes is {ro.sglang.nodes}, so the "
                          "run launches no SGLang servers; start each node's share with `rlrecipe rollout-servers "
                          f"{loaded.path} --node N --urls-out FILE` and pass --set \"rollout.urls=$(cat FILE)\"")


def check_rl_lora(loaded: LoadedRecipe, stage: str) -> None:
    """What trainer.lora RL cannot take (the schema checks recipes with an rl: section already)."""
    why = rl_lora_refusal(loaded.recipe) if stage == "rl" else None
    if why is not None:
        raise RecipeError(f"{loaded.path}: {why}")


def check_machine(loaded: LoadedRecipe, stage: str) -> None:
    """What `rlrecipe doctor` can already see will stop the stage (attention that cannot load, an
    output directory it cannot write, a disk too small, ...): one line each."""
    from rlrecipe.checks.doctor import failures, fatal_checks

    lines = failures(fatal_checks(loaded, stage))
    if lines:
        raise UserError(f"{loaded.path}: this machine cannot run it (`rlrecipe doctor {loaded.path}` for all checks):\n"
                        + "\n".join(f"  {line}" for line in lines))


def check_stage_inputs(loaded: LoadedRecipe, stage: str) -> str | None:
    """Model, data and rollout servers of a training stage (`sft` or `rl`), and what the machine can
    already be seen to lack, before its run directory is touched.

    Returns `run.init_from` resolved (another run's export as a path), the model the stage starts
    from when it names one: resolved once, here, for the stage to load."""
    require_train_data(loaded, stage)
    run = loaded.recipe.run
    init_from = resolve_init(run.init_from, run.output_dir)
    check_rollout_servers(loaded, stage)
    check_rl_lora(loaded, stage)
    check_machine(loaded, stage)
    config = check_model(loaded, init_from)
    check_context(loaded, config, stage)
    check_data(loaded, stage)
    return init_from
