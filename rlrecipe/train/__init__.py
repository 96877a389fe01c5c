"""Training engines behind one interface: plain torch and DeepSpeed ZeRO."""

from __future__ import annotations

from pathlib import Path

from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.recipe.training import ModelSection


def make_train_engine(trainer: TrainerSection, model: ModelSection, model_dir: str | Path, total_steps: int,
                      temperature: float = 1.0, colocated: bool = False):
    """The engine `trainer.engine` names, loading `model_dir` as `model` (dtype, attention,
    checkpointing) describes it; `temperature` divides the logits as the rollout's sampler did;
    `colocated`: it hands the GPU to the rollout between updates (offload_states / reload_states)."""
    kwargs = dict(dtype=model.dtype, temperature=temperature, gradient_checkpointing=model.gradient_checkpointing,
                  attn_implementation=model.attn_implementation)
    if trainer.engine == "deepspeed":
        from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model_dir, trainer, total_steps, colocated=colocated, **kwargs)
    from rlrecipe.train.torch_engine import TorchTrainEngine

    return TorchTrainEngine(model_dir, trainer, total_steps, **kwargs)
