"""Training engines behind one interface: plain torch and DeepSpeed ZeRO."""

from __future__ import annotations

from pathlib import Path

from rlrecipe.recipe import Recipe


def make_train_engine(recipe: Recipe, model_dir: str | Path, total_steps: int, temperature: float = 1.0):
    tr = recipe.trainer
    if tr.engine == "deepspeed":
        from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model_dir, tr, total_steps, dtype=recipe.model.dtype, temperature=temperature,
                                    gradient_checkpointing=recipe.model.gradient_checkpointing,
                                    attn_implementation=recipe.model.attn_implementation)
    from rlrecipe.train.torch_engine import TorchTrainEngine

    return TorchTrainEngine(model_dir, tr, total_steps, dtype=recipe.model.dtype, temperature=temperature,
                            gradient_checkpointing=recipe.model.gradient_checkpointing,
                            attn_implementation=recipe.model.attn_implementation)
