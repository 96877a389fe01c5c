"""What every training stage (SFT, RL) does around its loop.

start: check the stage's inputs (recipe, model, data, machine), then open the run directory
(rank-aware), seed, then resolve the model every rank trains once (rank 0 resolves it and records
it in the run, the others receive the path), and load its tokenizer.
finish: export the final HF model, write the run summary, then evaluate the final model on the
recipe's benchmarks (rank 0) and print the scores.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlrecipe.checks.preflight import check_stage_inputs
from rlrecipe.core.console import console
from rlrecipe.core.dist import broadcast_from_rank_zero, is_rank_zero
from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_tokenizer, model_record, resolve_model_dir
from rlrecipe.recipe.schema import LoadedRecipe, Recipe
from rlrecipe.run.env import record_model
from rlrecipe.run.rank_run import make_run
from rlrecipe.run.record import Run


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
    """Check the inputs, then make the run, then resolve the model: a stage that cannot start fails
    before its run directory is touched."""
    init_from = broadcast_from_rank_zero(lambda: check_stage_inputs(loaded, name))
    run = make_run(loaded, name, resume=resume, overwrite=overwrite)  # under torchrun: rank 0 alone writes
    try:
        torch.manual_seed(loaded.recipe.run.seed)
        model_dir = broadcast_from_rank_zero(lambda: starting_model(run, init_from))
        return Stage(loaded, run, Path(model_dir), load_tokenizer(model_dir))
    except BaseException:
        run.abandon()
        raise


def starting_model(run: Run, init_from: str | None) -> Path:
    """The model the run starts from (`init_from`: `run.init_from` resolved), recorded in its env.json
    with the snapshot commit and chat template it carries."""
    recipe = run.recipe
    path = resolve_model_dir(recipe.model, init_from, run.dir, recipe.run.seed)
    record = model_record(path, None if init_from else recipe.model.revision)
    record_model(run.dir, record)
    return path


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
