"""The RL stage: critic-free PPO with IcePop and C3PO++.

One step reads like the algorithm:
rollout (pool) -> grade -> recompute logp_train_old -> advantages -> IcePop weights ->
PPO minibatch updates -> push weights to the engine -> log -> checkpoint -> validate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rlrecipe.algo.advantages import scale_negative_advantages, sequence_advantages
from rlrecipe.algo.ppo import Remedies, aggregation_scale, mismatch_weights, policy_loss
from rlrecipe.c3po import PromptStream, RolloutPool
from rlrecipe.data.io import load_rows
from rlrecipe.errors import UserError
from rlrecipe.modeling import load_tokenizer, resolve_model_dir
from rlrecipe.recipe import LoadedRecipe, RLSection
from rlrecipe.reward import Grader, grade_trajectories
from rlrecipe.rollout.factory import make_rollout_engine
from rlrecipe.runs import Run, atomic_write_text, console, resolve_init
from rlrecipe.train import make_train_engine
from rlrecipe.train.base import TrainSample
from rlrecipe.train.launch import broadcast_from_rank_zero, is_rank_zero, make_run
from rlrecipe.trajectory import SamplingParams, Status, Trajectory

POOL_FILE = "pool.safetensors"


# -- the named steps ----------------------------------------------------------------------------
def grade(batch: list[Trajectory], tokenizer, grader: Grader, cfg: RLSection) -> None:
    grade_trajectories(batch, tokenizer, grader)
    for t in batch:
        t.reward = cfg.reward_correct if t.correct else cfg.reward_wrong


def collect_graded(pool: RolloutPool, engine, params: SamplingParams, tokenizer, grader: Grader, cfg: RLSection,
                   seed: int):
    """Rank 0's share of a step: roll out under the budget, then grade."""
    batch, roll = pool.collect(engine, params, seed=seed)
    grade(batch, tokenizer, grader, cfg)
    roll.extra = {"dropped_total": pool.total_dropped, "resumed_total": pool.total_resumed}
    return batch, roll


def recompute_old_logprobs(trainer, batch: list[Trajectory], reference=None
                           ) -> tuple[list[TrainSample], list[torch.Tensor], list[torch.Tensor]]:
    """logp_train_old and entropies under the trainer's current weights; with a reference policy
    (train/reference.py, for the KL penalty) also each sample's field logp_ref."""
    samples = [TrainSample(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in batch]
    out = trainer.compute_logprobs(samples)
    if reference is not None:
        for s, lr in zip(samples, reference.logprobs(samples), strict=True):
            s.fields["logp_ref"] = lr
    return samples, [lp for lp, _ in out], [en for _, en in out]


def attach_ppo_fields(samples: list[TrainSample], batch: list[Trajectory], logp_old: list[torch.Tensor],
                      cfg: RLSection) -> dict[str, float]:
    """Advantages, IcePop/TIS weights and what the V3.2 mask needs, as per-token fields of each
    sample (beside a logp_ref that `recompute_old_logprobs` put there)."""
    if cfg.kl_coef > 0 and any("logp_ref" not in s.fields for s in samples):
        raise ValueError("rl.kl_coef > 0 needs reference log-probs: pass a ReferencePolicy "
                         "(train/reference.py make_reference) to recompute_old_logprobs")
    lengths = [len(t.response_ids) for t in batch]
    adv = sequence_advantages([t.reward for t in batch], lengths, [t.group_id for t in batch], cfg.adv_norm)
    adv = scale_negative_advantages(adv, cfg.negative_adv_scale)
    masked = total = 0
    abs_gap = kl = adv_sum = 0.0
    ice = cfg.icepop
    for i, (s, a, lo, t) in enumerate(zip(samples, adv, logp_old, batch, strict=True)):
        li = torch.tensor(t.logp_infer)
        w, m = mismatch_weights(lo, li, ice.mode, ice.alpha, ice.beta, ice.tis_cap)
        s.fields.update({"logp_old": lo, "adv": torch.full_like(lo, a), "weight": w, "logp_infer": li,
                         "seq": torch.full(lo.shape, i, dtype=torch.long)})
        masked += int(m.sum())
        total += len(lo)
        adv_sum += a * len(lo)
        d = lo - li
        abs_gap += float(d.abs().sum())
        kl += float((torch.exp(d) - 1 - d).sum())  # k3 estimate of KL(infer || train)
    return {"icepop_masked_frac": masked / max(1, total), "mismatch_abs_logp": abs_gap / max(1, total),
            "mismatch_kl": kl / max(1, total), "adv_token_mean": adv_sum / max(1, total),
            "adv_negative_frac": sum(a < 0 for a in adv) / max(1, len(adv))}


def remedies_of(cfg: RLSection) -> Remedies:
    """The recipe's stability remedies, as the loss takes them."""
    cov = cfg.cov
    return Remedies(ratio_level=cfg.ratio_level, seq_eps_low=cfg.gspo_eps_low, seq_eps_high=cfg.gspo_eps_high,
                    cov_mode=cov.mode, cov_fraction=cov.kl_fraction if cov.mode == "kl_cov" else cov.clip_fraction,
                    clip_cov_low=cov.clip_low, clip_cov_high=cov.clip_high, kl_cov_coef=cov.kl_coef,
                    kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef)


def minibatch_slices(n_samples: int, n_minibatches: int) -> list[slice]:
    """Exactly min(n_minibatches, n_samples) consecutive slices whose sizes differ by at most one."""
    n = min(n_minibatches, n_samples)
    size, extra = divmod(n_samples, n) if n else (0, 0)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (i < extra)
        out.append(slice(start, stop))
        start = stop
    return out


def ppo_update(trainer, samples: list[TrainSample], cfg: RLSection) -> dict[str, float]:
    """One optimizer step per PPO minibatch, over consecutive slices of the batch.

    skipped_minibatches counts updates lost to a NaN/inf loss or gradient, but not those a float16
    loss scaler skipped on overflow while lowering its scale (overflow_minibatches): those are how
    loss scaling finds its scale, not a failing run."""
    totals: dict[str, float] = {}
    slices = minibatch_slices(len(samples), cfg.ppo_minibatches)
    remedies = remedies_of(cfg)

    def loss_fn(lp, f):
        return policy_loss(lp, f, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip, cfg.offpolicy_seq_delta,
                           cfg.early_stop_imp_ratio, remedies)

    loss_scale = None
    for sl in slices:
        mb = samples[sl]
        for s, scale in zip(mb, aggregation_scale([x.num_response for x in mb], cfg.loss_agg), strict=True):
            s.fields["scale"] = scale
        stats = trainer.train_step(mb, loss_fn, with_entropy=cfg.entropy_coef > 0)
        loss_scale = stats.pop("loss_scale", loss_scale)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
    steps = len(slices)
    active = max(1.0, totals.get("active_tokens", 0.0))
    overflow = totals.get("overflow", 0.0)
    out = {"loss": totals["loss"] / steps, "grad_norm": totals["grad_norm"] / steps, "lr": totals["lr"] / steps,
           "minibatches": float(steps), "skipped_minibatches": totals["skipped"] - overflow,
           "clip_frac": totals.get("clipped_tokens", 0.0) / active,
           "dual_clip_frac": totals.get("dual_clipped_tokens", 0.0) / active,
           "importance_ratio_mean": totals.get("ratio_sum", 0.0) / active,
           "early_stopped_microbatches": totals.get("early_stopped_microbatches", 0.0),
           "offpolicy_dropped_seqs": totals.get("offpolicy_dropped_seqs", 0.0)}
    out.update(_remedy_metrics(totals, steps, loss_scale))
    return out


def _remedy_metrics(totals: dict[str, float], steps: int, loss_scale: float | None) -> dict[str, float]:
    """Metrics of the remedies that are on (their stats are present only then)."""
    out: dict[str, float] = {}
    tokens = max(1.0, totals.get("tokens", 0.0))
    if "seqs" in totals:  # GSPO
        out["seq_ratio_mean"] = totals["seq_ratio_sum"] / max(1.0, totals["seqs"])
        out["seq_clip_frac"] = totals["seq_clipped"] / max(1.0, totals["seqs"])
    if "cov_selected_tokens" in totals:  # Clip-Cov / KL-Cov
        out["cov_selected_frac"] = totals["cov_selected_tokens"] / tokens
    if "kl_ref_sum" in totals:
        out["kl_ref"] = totals["kl_ref_sum"] / tokens
    if "entropy_bonus" in totals:
        out["entropy_bonus"] = totals["entropy_bonus"] / steps
    if loss_scale is not None:
        out["loss_scale"] = loss_scale
        out["overflow_minibatches"] = totals.get("overflow", 0.0)
    return out


def rollout_metrics(batch: list[Trajectory], entropy: list[torch.Tensor], version: int) -> dict[str, float]:
    lengths = [len(t.response_ids) for t in batch]
    staleness = [version - v for t in batch for v in t.versions]
    return {
        "reward_mean": sum(t.reward for t in batch) / len(batch),
        "accuracy": sum(bool(t.correct) for t in batch) / len(batch),
        "response_len_mean": sum(lengths) / len(batch),
        "response_len_max": max(lengths),
        "truncated_frac": sum(t.status == Status.TRUNCATED for t in batch) / len(batch),
        "entropy": float(torch.cat(entropy).mean()),
        "tokens_trained": sum(lengths),
        "staleness_max": max(staleness),
        "staleness_mean": sum(staleness) / len(staleness),
    }


# -- the loop -----------------------------------------------------------------------------------
def run_rl(loaded: LoadedRecipe, resume: bool = False, overwrite: bool = False) -> dict:
    """With several DeepSpeed ranks, rank 0 owns the rollout engine, the pool and the grader and
    hands each graded batch to every rank; all ranks train on it together."""
    recipe = loaded.recipe
    cfg = recipe.rl
    if not recipe.data.train:
        raise UserError(f"{loaded.path}: data.train: an RL prompt set is required")
    run = make_run(loaded, "rl", resume=resume, overwrite=overwrite)
    lead = is_rank_zero()
    torch.manual_seed(recipe.run.seed)
    model_dir = broadcast_from_rank_zero(lambda: resolve_model_dir(
        recipe.model, resolve_init(recipe.run.init_from, recipe.run.output_dir), run.dir, recipe.run.seed))
    tokenizer = load_tokenizer(model_dir)
    pool = None
    if lead:
        stream = PromptStream(load_rows(recipe.data.train, "rl"), tokenizer, recipe.data.prompt_template,
                              recipe.run.seed, recipe.data.shuffle)
        pool = RolloutPool(cfg, stream)
    trainer = make_train_engine(recipe, model_dir, cfg.steps * cfg.ppo_minibatches,
                                temperature=recipe.rollout.temperature)
    start = 0
    ckpt = broadcast_from_rank_zero(lambda: run.latest_checkpoint() if resume else None)
    if ckpt is not None:
        trainer.load(ckpt / "trainer")
        start = json.loads((ckpt / "progress.json").read_text())["step"]
        if lead:
            if (ckpt / POOL_FILE).exists():
                pool.load(ckpt / POOL_FILE)
            else:  # checkpoints written before the pool was stored as arrays
                pool.load_state_dict(json.loads((ckpt / "pool.json").read_text()))
            run.truncate_metrics(start)
            console.print(f"resumed from {ckpt} at step {start}")
    engine = make_rollout_engine(recipe, model_dir, tokenizer, version=start, run_dir=run.dir) if lead else None
    via_disk = recipe.rollout.engine != "inprocess" and recipe.rollout.sglang.weight_sync == "disk"
    if ckpt is not None:
        push_weights(trainer, engine, run, tokenizer, start, via_disk)
    ro = recipe.rollout
    params = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_new_tokens=ro.max_new_tokens)
    bad_in_a_row = 0
    t_start = time.time()
    try:
        with Grader() as grader:
            for step in range(start, cfg.steps):
                t0 = time.time()
                seed = recipe.run.seed * 100003 + step
                batch, roll = broadcast_from_rank_zero(
                    lambda: collect_graded(pool, engine, params, tokenizer, grader, cfg, seed))  # noqa: B023
                t_roll = time.time() - t0
                t1 = time.time()
                samples, logp_old, entropy = recompute_old_logprobs(trainer, batch)
                ice = attach_ppo_fields(samples, batch, logp_old, cfg)
                upd = ppo_update(trainer, samples, cfg)
                bad_in_a_row = bad_in_a_row + 1 if upd["skipped_minibatches"] == upd["minibatches"] else 0
                if bad_in_a_row >= cfg.max_bad_steps:
                    raise UserError(f"step {step + 1}: loss or gradient was NaN/inf in {bad_in_a_row} steps in a row; "
                                    "lower trainer.lr or check the data")
                push_weights(trainer, engine, run, tokenizer, step + 1, via_disk)
                t_train = time.time() - t1
                metrics = {**rollout_metrics(batch, entropy, step), **ice, **upd,
                           "tokens_generated": roll.generated_tokens, "pool_size": roll.pool_size,
                           "pool_mean_age": roll.mean_age, "pool_max_age": roll.max_age,
                           "dropped": roll.dropped, "resumed": roll.resumed,
                           **roll.extra,
                           "rollout_s": t_roll, "train_s": t_train,
                           "gen_tokens_per_s": roll.generated_tokens / max(t_roll, 1e-9)}
                if lead and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                    metrics.update(validate(loaded, engine, tokenizer, grader, run, step + 1))
                run.log(step + 1, metrics)
                if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                    with run.writing_checkpoint(step + 1) as d:
                        trainer.save(d / "trainer")
                        if lead:
                            pool.save(d / POOL_FILE)
                            atomic_write_text(d / "progress.json", json.dumps({"step": step + 1}))
    finally:
        if engine is not None:
            engine.close()
    final = trainer.export_hf(run.final_model_dir, tokenizer)
    console.print(f"RL done: {cfg.steps - start} steps in {time.time() - t_start:.1f}s; model at {final}")
    run.finish(token_columns=("tokens_trained", "tokens_generated"))  # before the evaluation records it
    results = {}
    if recipe.eval.benchmarks and lead:
        from rlrecipe.eval.runner import evaluate_model_dir

        results = evaluate_model_dir(loaded, final, Run(loaded, "eval", subdir="eval").dir)
        for name, s in results.items():
            console.print(f"[bold]{name}[/]: avg@{s['n']} = {s['avg']:.4f} ± {s['stderr']:.4f}")
    return results


def push_weights(trainer, engine, run: Run, tokenizer, version: int, via_disk: bool) -> None:
    """In memory for the in-process engine, by broadcast for SGLang with weight_sync distributed,
    else through an HF export on disk.

    Gathering a sharded trainer's weights is collective: every rank calls this; rank 0 (the one
    holding the engine) pushes."""
    if not via_disk:
        state = trainer.rollout_state()
        if engine is not None:
            engine.update_weights_from_state(state, version)
    else:
        export = trainer.export_hf(Path(run.dir) / "weights_for_rollout", tokenizer)
        if engine is not None:
            engine.update_weights_from_disk(export, version)


def validate(loaded: LoadedRecipe, engine, tokenizer, grader: Grader, run: Run, step: int) -> dict[str, float]:
    """Training-time validation through the shared evaluation path, with the rollout engine's weights."""
    from rlrecipe.eval.runner import evaluate_benchmarks

    out = evaluate_benchmarks(loaded.recipe, engine, tokenizer, grader,
                              out_dir=run.dir / "validation" / f"step_{step:07d}", model=f"{run.dir}@step{step}",
                              recipe_path=loaded.path, recipe_sha256=loaded.sha256)
    return {f"val/{name}/avg": s["avg"] for name, s in out.items()}
