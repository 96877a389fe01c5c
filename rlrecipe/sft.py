"""SFT distillation: prompt (chat template) + response + eos, loss on response tokens only."""

from __future__ import annotations

import math
import random
import time

import torch

from rlrecipe.console import console
from rlrecipe.data.io import load_rows
from rlrecipe.data.templates import sft_token_ids
from rlrecipe.errors import UserError
from rlrecipe.modeling import load_tokenizer, resolve_model_dir
from rlrecipe.recipe import LoadedRecipe
from rlrecipe.runs import Run, resolve_init
from rlrecipe.train import make_train_engine
from rlrecipe.train.base import TrainSample
from rlrecipe.train.launch import broadcast_from_rank_zero, is_rank_zero, make_run


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
    random.Random(seed * 100003 + epoch).shuffle(order)
    return [samples[j] for j in order[i * batch_size:(i + 1) * batch_size]]


def sft_loss(logp: torch.Tensor, f: dict[str, torch.Tensor]):
    return -(logp * f["scale"]).sum(), {"nll_sum": float(-logp.detach().sum())}


def run_sft(loaded: LoadedRecipe, resume: bool = False, overwrite: bool = False) -> dict:
    recipe = loaded.recipe
    if not recipe.data.train:
        raise UserError(f"{loaded.path}: data.train: an SFT dataset is required")
    run = make_run(loaded, "sft", resume=resume, overwrite=overwrite)  # under torchrun: rank 0 alone writes records
    torch.manual_seed(recipe.run.seed)
    model_dir = broadcast_from_rank_zero(lambda: resolve_model_dir(
        recipe.model, resolve_init(recipe.run.init_from, recipe.run.output_dir), run.dir, recipe.run.seed))
    tokenizer = load_tokenizer(model_dir)
    samples, cut = build_sft_samples(load_rows(recipe.data.train, "sft"), tokenizer, recipe.data.prompt_template,
                                     recipe.sft.max_length)
    if not samples:
        raise UserError(f"{recipe.data.train}: no usable SFT rows")
    per_epoch = math.ceil(len(samples) / recipe.sft.batch_size)
    total = recipe.sft.max_steps or recipe.sft.epochs * per_epoch
    engine = make_train_engine(recipe, model_dir, total)
    start = 0
    ckpt = run.latest_checkpoint() if resume else None
    if ckpt is not None:
        engine.load(ckpt)
        start = engine.steps_done
        run.truncate_metrics(start)
        console.print(f"resumed from {ckpt} at step {start}")
    console.print(f"SFT: {len(samples)} examples ({cut} cut to max_length), {total} steps of "
                  f"{recipe.sft.batch_size}; model {model_dir}")
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("sft", total=total, completed=start)
        for step in range(start, total):
            t0 = time.time()
            batch = batch_for_step(samples, step, recipe.sft.batch_size, recipe.run.seed)
            n_tok = sum(s.num_response for s in batch)
            for s in batch:
                s.fields = {"scale": torch.full((s.num_response,), 1.0 / n_tok)}
            stats = engine.train_step(batch, sft_loss)
            dt = time.time() - t0
            metrics = {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                       "tokens": n_tok, "tokens_per_s": sum(len(s.input_ids) for s in batch) / dt,
                       "epoch": step / per_epoch, "skipped": stats["skipped"]}
            every = recipe.sft.eval_every
            if every and (step + 1) % every == 0 and step + 1 < total:
                metrics.update(_validate(loaded, engine, tokenizer, run, step + 1))
            run.log(step + 1, metrics, echo=(step + 1) % 10 == 0 or step + 1 == total)
            bar.advance(task)
            if (step + 1) % recipe.sft.save_every == 0 or step + 1 == total:
                with run.writing_checkpoint(step + 1) as d:
                    engine.save(d)
    final = engine.export_hf(run.final_model_dir, tokenizer)
    run.finish(token_columns=("tokens",))  # before the evaluation, which records this run's cost
    results = {}
    if recipe.eval.benchmarks and is_rank_zero():
        from rlrecipe.eval.runner import evaluate_model_dir

        results = evaluate_model_dir(loaded, final, Run(loaded, "eval", subdir="eval").dir)
        for name, s in results.items():
            console.print(f"[bold]{name}[/]: avg@{s['n']} = {s['avg']:.4f} ± {s['stderr']:.4f}")
    return results


def _validate(loaded: LoadedRecipe, engine, tokenizer, run: Run, step: int) -> dict[str, float]:
    """Training-time validation through the shared evaluation path, on the current weights."""
    from rlrecipe.eval.runner import evaluate_model_dir

    export = engine.export_hf(run.dir / "validation_model", tokenizer)
    if not is_rank_zero():
        return {}
    out = evaluate_model_dir(loaded, export, run.dir / "validation" / f"step_{step:07d}")
    return {f"val/{name}/avg": s["avg"] for name, s in out.items()}
