"""SFT distillation: prompt (chat template) + response + eos, loss on response tokens only."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from rlrecipe.algo.columns import Sums, TokenColumns
from rlrecipe.core.console import console
from rlrecipe.core.dist import is_rank_zero
from rlrecipe.core.errors import UserError
from rlrecipe.core.seeds import SFT_EPOCH, mix_seed
from rlrecipe.data.io import load_rows
from rlrecipe.data.templates import sft_token_ids
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.run.checkpoints import check_resume_step
from rlrecipe.run.metrics_file import read_metrics
from rlrecipe.run.record import Run
from rlrecipe.stages.lifecycle import Stage, finish_stage, start_stage
from rlrecipe.train import make_train_engine
from rlrecipe.train.bad_steps import BadStepGuard, sft_step_skipped
from rlrecipe.train.base import TrainSample


def build_sft_samples(rows: list[dict], tokenizer, template: str, max_length: int) -> tuple[list[TrainSample], int]:
    """Tokenise rows; a row longer than max_length has its response cut (counted, returned)."""
    samples, cut = [], 0
    for row in rows:
        full, n_prompt = sft_token_ids(tokenizer, row, template)
        ids = full[:max_length]
        if len(ids) <= n_prompt:
            cut += 1
            continue
        cut += len(ids) < len(full)
        samples.append(TrainSample(ids, n_prompt))
    return samples, cut


def batch_for_step(samples: list[TrainSample], step: int, batch_size: int, seed: int) -> list[TrainSample]:
    """Deterministic in the step alone, so a resumed run sees exactly the batches it would have."""
    per_epoch = math.ceil(len(samples) / batch_size)
    epoch, i = divmod(step, per_epoch)
    order = list(range(len(samples)))
    random.Random(mix_seed(seed, epoch, SFT_EPOCH)).shuffle(order)
    return [samples[j] for j in order[i * batch_size:(i + 1) * batch_size]]


# Consecutive steps whose loss or gradient was NaN/inf (the engine skipped their update) before SFT
# stops, as rl.max_bad_steps does for RL.
MAX_BAD_STEPS = 3


@dataclass
class NllStats(Sums):
    nll_sum: float = 0.0


def sft_loss(logp: torch.Tensor, cols: TokenColumns) -> tuple[torch.Tensor, NllStats]:
    (scale,) = cols.need("scale")
    return -(logp * scale).sum(), NllStats(nll_sum=float(-logp.detach().sum()))


def run_sft(loaded: LoadedRecipe, resume: bool = False, overwrite: bool = False) -> dict:
    stage = start_stage(loaded, "sft", resume, overwrite)
    with stage.failing_safely():
        return _train(loaded, stage)


def _train(loaded: LoadedRecipe, stage: Stage) -> dict:
    recipe, run, tokenizer = stage.recipe, stage.run, stage.tokenizer
    cfg = recipe.sft
    samples, cut = build_sft_samples(load_rows(recipe.data.train, "sft"), tokenizer, recipe.data.prompt_template,
                                     cfg.max_length)
    if not samples:
        raise UserError(f"{recipe.data.train}: no usable SFT rows")
    per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    engine = make_train_engine(recipe.trainer, recipe.model, stage.model_dir, total)
    start = resume_sft(engine, run)
    guard = BadStepGuard(MAX_BAD_STEPS, "sft", sft_step_skipped)
    guard.resume(read_metrics(run.metrics_path))  # the metrics were cut back to the checkpoint
    console.print(f"SFT: {len(samples)} examples ({cut} cut to max_length), {total} steps of "
                  f"{cfg.batch_size}; model {stage.model_dir}")
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("sft", total=total, completed=start)
        for step in range(start, total):
            t0 = time.time()
            batch = batch_for_step(samples, step, cfg.batch_size, recipe.run.seed)
            stats = sft_step(engine, batch)
            guard.check(stats, step + 1)
            step_s = time.time() - t0
            # tokens_per_s counts every token the step ran (prompt and response); `tokens` only the response
            metrics = {**stats, "step_s": step_s, "tokens_per_s": sum(len(s.input_ids) for s in batch) / step_s,
                       "epoch": step / per_epoch}
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total:
                metrics.update(_validate(loaded, engine, tokenizer, run, step + 1))
            run.log(step + 1, metrics, echo=(step + 1) % 10 == 0 or step + 1 == total, total=total)
            bar.advance(task)
            if (step + 1) % cfg.save_every == 0 or step + 1 == total:
                with run.writing_checkpoint(step + 1) as d:
                    engine.save(d)
    return finish_stage(stage, engine, token_columns=("tokens",))


def resume_sft(engine, run: Run) -> int:
    """The step to start from: 0, or the checkpoint the run chose (its later metrics dropped)."""
    ckpt = run.latest_checkpoint()
    if ckpt is None:
        return 0
    engine.load(ckpt)
    check_resume_step(ckpt, engine.steps_done)
    run.truncate_metrics(engine.steps_done)
    console.print(f"resumed from {ckpt} at step {engine.steps_done}")
    return engine.steps_done


def sft_step(engine, batch: list[TrainSample]) -> dict[str, float]:
    """One optimizer step: mean NLL over the batch's response tokens."""
    n_tok = sum(s.num_response for s in batch)
    for s in batch:
        s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / n_tok))
    step = engine.train_step(batch, sft_loss)
    return {"loss": step.loss, "grad_norm": step.grad_norm, "lr": step.lr, "tokens": n_tok,
            "skipped": float(step.skipped)}


def _validate(loaded: LoadedRecipe, engine, tokenizer, run: Run, step: int) -> dict[str, float]:
    """Training-time validation through the shared evaluation path, on the current weights."""
    from rlrecipe.eval.runner import evaluate_model_dir

    export = engine.export_hf(run.dir / "validation_model", tokenizer)
    if not is_rank_zero():
        return {}
    out = evaluate_model_dir(loaded, export, run.dir / "validation" / f"step_{step:07d}")
    return {f"val/{name}/avg": s["avg"] for name, s in out.items()}
