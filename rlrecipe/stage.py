"""What every training stage (SFT, RL) does around its loop.

start: check the recipe has training data, open the run directory (rank-aware), seed, resolve
the model every rank trains (rank 0 resolves, the others receive the path), load its tokenizer.
finish: export the final HF model, write the run summary, then evaluate the final model on the
recipe's benchmarks (rank 0) and print the scores.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlrecipe.console import console
from rlrecipe.errors import UserError
from rlrecipe.modeling import load_tokenizer, resolve_model_dir
from rlrecipe.rank_run import make_run
from rlrecipe.recipe import LoadedRecipe, Recipe
from rlrecipe.runs import Run, resolve_init
from rlrecipe.train.launch import broadcast_from_rank_zero, is_rank_zero

TRAIN_DATA = {"sft": "an SFT dataset", "rl": "an RL prompt set"}


@dataclass
class Stage:
    loaded: LoadedRecipe
    run: Run
    model_dir: Path
    tokenizer: Any

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

    @contextmanager
    def failing_safely(self):
        """Around a stage's work: if it fails, the run directory is let go (no stale lock owner) and an
        earlier run that --overwrite set aside comes back, unless this run already wrote a checkpoint."""
        try:
            yield self
        except BaseException:
            self.run.abandon()
            raise


def start_stage(loaded: LoadedRecipe, name: str, resume: bool, overwrite: bool) -> Stage:
    recipe = loaded.recipe
    if not recipe.data.train:
        raise UserError(f"{loaded.path}: data.train: {TRAIN_DATA[name]} is required")
    run = make_run(loaded, name, resume=resume, overwrite=overwrite)  # under torchrun: rank 0 alone writes
    try:
        torch.manual_seed(recipe.run.seed)
        model_dir = broadcast_from_rank_zero(lambda: resolve_model_dir(
            recipe.model, resolve_init(recipe.run.init_from, recipe.run.output_dir), run.dir, recipe.run.seed))
        return Stage(loaded, run, Path(model_dir), load_tokenizer(model_dir))
    except BaseException:
        run.abandon()
        raise


def check_finite_weights(trainer, stage: str) -> None:
    """The weights about to be exported hold no NaN/inf: a step whose loss and gradient were finite can
    still blow them up (a huge learning rate), and the next stage would start from them. (ZeRO-3's
    partitioned parameters are empty here and left to the bad-step guards.)"""
    model = getattr(trainer, "model", None)
    if model is None:
        return
    for name, p in model.named_parameters():
        if p.numel() and not bool(torch.isfinite(p.detach()).all()):
            raise UserError(f"{stage}: the trained weights hold NaN/inf ({name}); not exporting them: lower "
                            "trainer.lr or check the data")


def finish_stage(stage: Stage, trainer, token_columns: tuple[str, ...]) -> dict:
    """The final model, the run's cost summary, then its evaluation (which records that cost)."""
    check_finite_weights(trainer, stage.run.stage)
    final = trainer.export_hf(stage.run.final_model_dir, stage.tokenizer)
    stage.run.finish(token_columns=token_columns)
    if not (stage.recipe.eval.benchmarks and is_rank_zero()):
        return {}
    from rlrecipe.eval.runner import evaluate_model_dir

    records = Run(stage.loaded, "eval", subdir="eval")
    try:
        results = evaluate_model_dir(stage.loaded, final, records.dir)
    finally:
        records.release()  # no stale owner for the next `rlrecipe eval` to find
    for name, s in results.items():
        console.print(f"[bold]{name}[/]: avg@{s['n']} = {s['avg']:.4f} ± {s['stderr']:.4f}")
    return results
