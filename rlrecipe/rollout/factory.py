"""Pick the rollout engine a recipe asks for."""

from __future__ import annotations

from pathlib import Path

from rlrecipe.recipe.schema import Recipe
from rlrecipe.rollout.base import RolloutEngine


def make_rollout_engine(recipe: Recipe, model_dir: str | Path, tokenizer, version: int = 0,
                        run_dir: Path | None = None, beside_training: bool = False) -> RolloutEngine:
    """`beside_training`: the caller trains on this node (RL's rank 0), so SGLang servers it launches
    must leave the trainer's GPUs alone; evaluation alone passes False."""
    ro = recipe.rollout
    if ro.engine == "sglang":
        from rlrecipe.rollout.sglang.engine import SGLangEngine

        return SGLangEngine.from_recipe(recipe, model_dir, tokenizer, version=version, run_dir=run_dir,
                                        beside_training=beside_training)
    from rlrecipe.rollout.inprocess import InProcessEngine

    return InProcessEngine(model_dir, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           dtype=ro.dtype, max_batch=ro.max_batch, refill_fraction=ro.refill_fraction,
                           version=version, kv_cache_dtype=ro.kv_cache_dtype, kv_scales=ro.kv_scales)
