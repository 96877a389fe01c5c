"""The RL stage: critic-free PPO with IcePop and C3PO++.

`run_rl` reads like the algorithm; the named steps it calls come first, its plumbing (the pool,
sampling, validation) after it. What a checkpoint holds and how a run resumes from one are
rlrecipe/rl/checkpoint.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from rlrecipe.algo.advantages import scale_negative_advantages, sequence_advantages
from rlrecipe.algo.dapo import overlong_penalty
from rlrecipe.algo.entropy_watch import EntropyWatch
from rlrecipe.algo.m2po import batch_masks
from rlrecipe.algo.ppo import (
    LossSettings,
    Remedies,
    aggregation_scale,
    importance_ratio_sums,
    mismatch_weights,
    policy_loss,
)
from rlrecipe.core.console import console
from rlrecipe.core.dist import is_rank_zero
from rlrecipe.data.io import load_rows
from rlrecipe.recipe.schema import LoadedRecipe, Recipe
from rlrecipe.recipe.systems import RolloutSection
from rlrecipe.recipe.training import RLSection
from rlrecipe.reward import Grader, grade_trajectories
from rlrecipe.rl.checkpoint import resume_rl, save_rl_checkpoint
from rlrecipe.rl.colocate import TakingTurns
from rlrecipe.rl.pool import RolloutPool
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rl.schedule import StepRollout, WeightsOut
from rlrecipe.rl.step_timer import StepTimer
from rlrecipe.rollout.factory import make_rollout_engine
from rlrecipe.rollout.weights.transport import weight_transport
from rlrecipe.run.record import Run
from rlrecipe.stages.lifecycle import finish_stage, start_stage
from rlrecipe.train import make_train_engine
from rlrecipe.train.bad_steps import BadStepGuard, rl_step_skipped
from rlrecipe.train.base import TrainSample, add_sums
from rlrecipe.train.reference import make_reference
from rlrecipe.trajectory.arrays import TrajectoryBatch
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


# -- the named steps ----------------------------------------------------------------------------
def grade(batch: list[Trajectory], tokenizer, grader: Grader, cfg: RLSection, max_new_tokens: int = 0) -> None:
    """The verdict's reward, plus DAPO's soft overlong penalty on the whole response's length when
    rl.overlong.cache is set. Only ended rollouts are graded, so one C3PO++'s budget cut (resumed
    later) is never penalised for the part it had then; truncated ones are at max_new_tokens."""
    grade_trajectories(batch, tokenizer, grader)
    ov = cfg.overlong
    for t in batch:
        t.reward = cfg.reward_correct if t.correct else cfg.reward_wrong
        if ov.cache:
            t.reward += overlong_penalty(len(t.response_ids), max_new_tokens, ov.cache, ov.penalty)


def collect_graded(pool: RolloutPool, engine, params: SamplingParams, tokenizer, grader: Grader, cfg: RLSection,
                   seed: int):
    """Rank 0's share of a step: roll out under the budget, grade, pack the batch into arrays (the
    pool keeps the Trajectory objects). With dynamic sampling the pool grades groups as they
    complete; what it did not grade is graded here."""
    t0 = time.time()
    judge = partial(grade, tokenizer=tokenizer, grader=grader, cfg=cfg, max_new_tokens=params.max_new_tokens)
    batch, roll = pool.collect(engine, params, seed=seed, judge=judge if pool.dynamic else None)
    t1 = time.time()
    grade([t for t in batch if t.correct is None], tokenizer, grader, cfg, params.max_new_tokens)
    roll.graded, roll.grade_s = len(batch), time.time() - t1
    roll.dropped_total, roll.resumed_total = pool.total_dropped, pool.total_resumed
    roll.prompts_skipped_too_long = pool.stream.skipped_too_long
    roll.engine = engine.fleet_metrics()
    if roll.dynamic is not None:
        roll.dynamic.collect_s = t1 - t0
    if cfg.overlong.cache:
        ov = cfg.overlong
        roll.overlong_penalty_mean = sum(
            overlong_penalty(len(t.response_ids), params.max_new_tokens, ov.cache, ov.penalty) for t in batch
        ) / max(1, len(batch))
    return TrajectoryBatch.from_trajectories(batch), roll


def recompute_old_logprobs(trainer, batch: TrajectoryBatch, reference=None
                           ) -> tuple[list[TrainSample], list[torch.Tensor], list[torch.Tensor]]:
    """logp_train_old and entropies under the trainer's current weights; with a reference policy
    (train/reference.py, for the KL penalty) also each sample's field logp_ref."""
    samples = [TrainSample(batch.input_ids(i), batch.prompt_length(i)) for i in range(len(batch))]
    out = trainer.compute_logprobs(samples)
    if reference is not None:
        for s, lr in zip(samples, reference.logprobs(samples), strict=True):
            s.columns.logp_ref = lr
    return samples, [lp for lp, _ in out], [en for _, en in out]


def attach_ppo_fields(samples: list[TrainSample], batch: TrajectoryBatch,
                      logp_old: list[torch.Tensor], cfg: RLSection) -> dict[str, float]:
    """The prepare step: advantages, IcePop/TIS weights and what the V3.2 mask and GSPO need, as
    each sample's token columns (beside the logp_ref that `recompute_old_logprobs` put there)."""
    if cfg.kl_coef > 0 and any(s.columns.logp_ref is None for s in samples):
        raise ValueError("rl.kl_coef > 0 needs reference log-probs: pass a ReferencePolicy "
                         "(train/reference.py make_reference) to recompute_old_logprobs")
    adv = sequence_advantages(batch.rewards, batch.response_lengths, batch.group_ids, cfg.adv_norm, cfg.adv_quantile)
    adv = scale_negative_advantages(adv, cfg.negative_adv_scale)
    # DAPO's overlong filtering: a response truncated at max_new_tokens leaves the loss (weight 0)
    # but keeps its reward in the advantages and its tokens in the normaliser
    overlong = [cfg.overlong.filter and s == Status.TRUNCATED for s in batch.statuses]
    masked = total = 0
    abs_gap = kl = adv_sum = 0.0
    ice = cfg.icepop
    gaps = [lo - batch.logp_infer(i) for i, lo in enumerate(logp_old)]  # log(pi_old / pi_infer) per token
    # M2PO decides over the whole batch; the tokens already out of the loss are not candidates
    second_moment = (batch_masks(gaps, [torch.full_like(d, 0.0 if cut else a) for d, a, cut in
                                        zip(gaps, adv, overlong, strict=True)], ice.m2_threshold)
                     if ice.mode == "m2po" else None)
    for i, (s, a, lo, d) in enumerate(zip(samples, adv, logp_old, gaps, strict=True)):
        li = batch.logp_infer(i)  # a float32 view into the batch's array
        w, m = mismatch_weights(lo, li, ice.mode, ice.alpha, ice.beta, ice.tis_cap)
        if second_moment is not None:
            m = second_moment[i]
            w = w.masked_fill(m, 0.0)
        if overlong[i]:
            w = torch.zeros_like(w)
        c = s.columns
        c.logp_old, c.adv, c.weight, c.logp_infer = lo, torch.full_like(lo, a), w, li
        c.seq = torch.full(lo.shape, i, dtype=torch.long)
        masked += int(m.sum())
        total += len(lo)
        adv_sum += a * len(lo)
        abs_gap += float(d.abs().sum())
        kl += float((torch.exp(d) - 1 - d).sum())  # k3 estimate of KL(infer || train)
    out = {"icepop_masked_frac": masked / max(1, total), "mismatch_abs_logp": abs_gap / max(1, total),
           "mismatch_kl": kl / max(1, total), "adv_token_mean": adv_sum / max(1, total),
           "adv_negative_frac": sum(a < 0 for a in adv) / max(1, len(adv))}
    if cfg.adv_norm in ("group_mean", "group_quantile"):
        out["adv_zero_frac"] = sum(a == 0 for a in adv) / max(1, len(adv))  # QAE: responses with no credit
    if cfg.overlong.filter:
        out["overlong_filtered_frac"] = sum(overlong) / max(1, len(overlong))
    return out


def loss_settings(cfg: RLSection) -> LossSettings:
    """The recipe's clip ranges and stability remedies, as the loss takes them."""
    cov = cfg.cov
    remedies = Remedies(ratio_level=cfg.ratio_level, seq_eps_low=cfg.gspo_eps_low, seq_eps_high=cfg.gspo_eps_high,
                        cov_mode=cov.mode, cov_fraction=cov.kl_fraction if cov.mode == "kl_cov" else cov.clip_fraction,
                        clip_cov_low=cov.clip_low, clip_cov_high=cov.clip_high, kl_cov_coef=cov.kl_coef,
                        kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef)
    return LossSettings(eps_low=cfg.eps_clip_low, eps_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
                        offpolicy_delta=cfg.offpolicy_seq_delta, remedies=remedies)


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


def minibatch_importance_ratio(trainer, minibatch: list[TrainSample], settings: LossSettings) -> float:
    """Mean pi_theta / pi_old over the tokens of a whole PPO minibatch that would train, under the
    weights it is about to update (a forward without gradient, collective: every rank gets every
    sample's log-probs, so all decide alike). AReaL's early stop decides per micro-batch; over the
    minibatch the decision does not move with micro-batch size, ranks or nodes."""
    ratio = active = 0.0
    for s, (logp, _) in zip(minibatch, trainer.compute_logprobs(minibatch), strict=True):
        r, a = importance_ratio_sums(logp, s.columns, settings)
        ratio, active = ratio + r, active + a
    return ratio / active if active else 1.0


def ppo_update(trainer, samples: list[TrainSample], cfg: RLSection) -> dict[str, float]:
    """One optimizer step per PPO minibatch, over consecutive slices of the batch.

    skipped_minibatches counts updates lost to a NaN/inf loss or gradient, but not those a float16
    loss scaler skipped on overflow while lowering its scale (overflow_minibatches): those are how
    loss scaling finds its scale, not a failing run."""
    totals: dict[str, float] = {}
    slices = minibatch_slices(len(samples), cfg.ppo_minibatches)
    settings = loss_settings(cfg)

    def loss_fn(lp, cols):
        return policy_loss(lp, cols, settings)

    def stopped_loss_fn(lp, cols):
        return policy_loss(lp, cols, replace(settings, stopped=True))

    loss_scale = None
    stopped = 0
    for k, sl in enumerate(slices):
        mb = samples[sl]
        for s, scale in zip(mb, aggregation_scale([x.num_response for x in mb], cfg.loss_agg), strict=True):
            s.columns.scale = scale
        # the first minibatch trains the weights that computed logp_old: its ratio is 1
        stop = k > 0 and cfg.early_stop_imp_ratio is not None and (
            minibatch_importance_ratio(trainer, mb, settings) > cfg.early_stop_imp_ratio)
        stopped += stop
        result = trainer.train_step(mb, stopped_loss_fn if stop else loss_fn, with_entropy=cfg.entropy_coef > 0)
        loss_scale = result.loss_scale if result.loss_scale is not None else loss_scale
        add_sums(totals, result.additive())
    steps = len(slices)
    active = max(1.0, totals.get("active_tokens", 0.0))
    overflow = totals.get("overflow", 0.0)
    out = {"loss": totals["loss"] / steps, "grad_norm": totals["grad_norm"] / steps, "lr": totals["lr"] / steps,
           "minibatches": float(steps), "skipped_minibatches": totals["skipped"] - overflow,
           "clip_frac": totals.get("clipped_tokens", 0.0) / active,
           "dual_clip_frac": totals.get("dual_clipped_tokens", 0.0) / active,
           "importance_ratio_mean": totals.get("ratio_sum", 0.0) / active,
           "early_stopped_minibatches": float(stopped),
           "offpolicy_dropped_seqs": totals.get("offpolicy_dropped_seqs", 0.0)}
    out.update(_remedy_metrics(totals, steps, loss_scale, settings.remedies))
    return out


def _remedy_metrics(totals: dict[str, float], steps: int, loss_scale: float | None,
                    rem: Remedies) -> dict[str, float]:
    """Metrics of the remedies the recipe turned on."""
    out: dict[str, float] = {}
    tokens = max(1.0, totals.get("tokens", 0.0))
    if rem.ratio_level == "sequence":  # GSPO
        out["seq_ratio_mean"] = totals["seq_ratio_sum"] / max(1.0, totals["seqs"])
        out["seq_clip_frac"] = totals["seq_clipped"] / max(1.0, totals["seqs"])
    if rem.cov_mode != "off":  # Clip-Cov / KL-Cov
        out["cov_selected_frac"] = totals["cov_selected_tokens"] / tokens
    if rem.kl_coef > 0:
        out["kl_ref"] = totals["kl_ref_sum"] / tokens
    if rem.entropy_coef > 0:
        out["entropy_bonus"] = totals["entropy_bonus"] / steps
    if loss_scale is not None:
        out["loss_scale"] = loss_scale
        out["overflow_minibatches"] = totals.get("overflow", 0.0)
    return out


def rollout_metrics(batch: TrajectoryBatch, entropy: list[torch.Tensor],
                    version: int) -> dict[str, float]:
    lengths = batch.response_lengths
    staleness = version - batch.arrays["versions"].long()  # per token; int64 so the sum cannot overflow
    return {
        "reward_mean": sum(batch.rewards) / len(batch),
        "accuracy": sum(bool(c) for c in batch.correct) / len(batch),
        "response_len_mean": sum(lengths) / len(batch),
        "response_len_max": max(lengths),
        "truncated_frac": sum(s == Status.TRUNCATED for s in batch.statuses) / len(batch),
        "entropy": float(torch.cat(entropy).mean()),
        "tokens_trained": sum(lengths),
        "staleness_max": int(staleness.max()),
        "staleness_mean": int(staleness.sum()) / staleness.numel(),
        "staleness_tokens": torch.bincount(staleness.clamp(min=0)).tolist(),  # tokens by versions behind
    }


# -- the loop -----------------------------------------------------------------------------------
def run_rl(loaded: LoadedRecipe, resume: bool = False, overwrite: bool = False) -> dict:
    """Each step: collect a graded batch -> recompute logp_train_old -> advantages and IcePop/TIS
    weights -> PPO minibatch updates -> push weights to the rollout engine (after every
    rollout.weight_update_every-th step) -> log -> checkpoint
    -> validate.

    With several DeepSpeed ranks, rank 0 owns the rollout engine, the pool and the grader and
    hands each graded batch to every rank as arrays (a TrajectoryBatch); all ranks train on it together."""
    stage = start_stage(loaded, "rl", resume, overwrite)
    with stage.failing_safely():
        return _train(loaded, stage)


@dataclass
class RLParts:
    """What the loop works with: built once per run (every rank; the engine, pool and grader's
    side on rank 0 only)."""

    trainer: object
    reference: object
    pool: RolloutPool | None
    engine: object
    watch: EntropyWatch
    guard: BadStepGuard
    turns: TakingTurns
    weights_out: WeightsOut
    start: int
    resumed_from: Path | None


def _build(stage) -> RLParts:
    recipe, run, tokenizer, cfg = stage.recipe, stage.run, stage.tokenizer, stage.recipe.rl
    # first: a push that cannot carry the recipe's weights (an adapter over ipc) stops before anything loads
    transport = weight_transport(recipe.rollout.engine, recipe.rollout.sglang, lora=recipe.trainer.lora.enabled)
    lead = is_rank_zero()
    pool = make_pool(recipe, tokenizer) if lead else None
    colocated = recipe.rollout.colocate
    trainer = make_train_engine(recipe.trainer, recipe.model, stage.model_dir, cfg.steps * cfg.ppo_minibatches,
                                temperature=recipe.rollout.temperature, colocated=colocated)
    reference = make_reference(recipe, stage.model_dir, trainer)  # None unless rl.kl_coef > 0
    watch = EntropyWatch.from_config(cfg.entropy_watch, quiet=not lead)
    guard = BadStepGuard(cfg.max_bad_steps, "rl", rl_step_skipped)
    start, resumed_from = resume_rl(run, trainer, pool, watch, guard)
    turns = TakingTurns(trainer, colocated)  # colocated: rollout and training take turns on the GPUs
    weights_out = WeightsOut(trainer, run, tokenizer, transport, start,
                             bucket_bytes=recipe.rollout.sglang.weight_sync_bucket_mb << 20, turns=turns)
    turns.before_rollout_starts()  # colocated: the trainer leaves the GPU to the engine about to start
    engine = make_rollout_engine(recipe, stage.model_dir, tokenizer, version=start, run_dir=run.dir,
                                 beside_training=not colocated) if lead else None
    turns.attach(engine)
    weights_out.attach(engine)
    return RLParts(trainer, reference, pool, engine, watch, guard, turns, weights_out, start, resumed_from)


def _train(loaded: LoadedRecipe, stage) -> dict:
    recipe, run, tokenizer, cfg = stage.recipe, stage.run, stage.tokenizer, stage.recipe.rl
    parts = _build(stage)
    params = sampling_params(recipe.rollout)
    t_start = time.time()
    t_mark = t_start  # the end of the last step's row: a step's wall time runs from there (validation left out)
    rollout = None
    try:
        with Grader() as grader:
            collect = partial(collect_graded, parts.pool, parts.engine, params, tokenizer, grader, cfg)
            rollout = StepRollout(recipe, collect, parts.weights_out, parts.start, parts.resumed_from)
            for step in range(parts.start, cfg.steps):
                timer = StepTimer()
                with timer("rollout_s"):  # synchronous: collected now; asynchronous: collected ahead
                    batch, roll = rollout.batch_for(step)
                with timer("train_s"):
                    weights, update, entropy = _update(parts, batch, cfg, step)
                    rollout.trained(step + 1)  # synchronous: push the weights (when due)
                metrics = {**rollout_metrics(batch, entropy, step), **weights, **update, **roll.metrics(),
                           **timer.seconds, **rollout.timing(timer.seconds["rollout_s"], roll.generated_tokens),
                           **parts.turns.seconds()}
                metrics.update(parts.watch.update(metrics["entropy"], step + 1))
                validation_s = _validate_if_due(loaded, stage, parts.engine, rollout, grader, metrics, step)
                # wall time of the step as training sees it: since the last row (its checkpoint included),
                # less the validation itself (the drain before it stays: it is rollout work)
                now = time.time()
                metrics["step_wall_s"], t_mark = now - t_mark - validation_s, now
                run.log(step + 1, metrics, total=cfg.steps)
                _checkpoint_if_due(parts, rollout, run, cfg, step)
    finally:
        if rollout is not None:
            rollout.close()
        if parts.engine is not None:
            parts.engine.close()
    console.print(f"RL done: {cfg.steps - parts.start} steps in {time.time() - t_start:.1f}s")
    parts.turns.trainer_back()
    return finish_stage(stage, parts.trainer, token_columns=("tokens_trained", "tokens_generated"))


def _update(parts: RLParts, batch: TrajectoryBatch, cfg, step: int) -> tuple[dict, dict, torch.Tensor]:
    """The PPO update on a graded batch: old log-probs, advantages and IcePop/TIS weights, minibatches."""
    with parts.turns.training():  # colocated: the engine releases the GPUs for the update
        samples, logp_old, entropy = recompute_old_logprobs(parts.trainer, batch, parts.reference)
        weights = attach_ppo_fields(samples, batch, logp_old, cfg)
        update = ppo_update(parts.trainer, samples, cfg)
        parts.guard.check(update, step + 1)
    return weights, update, entropy


def _validate_if_due(loaded: LoadedRecipe, stage, engine, rollout, grader, metrics: dict, step: int) -> float:
    """Held-out validation every rl.eval_every steps (rank 0), into `metrics`; its seconds."""
    cfg = loaded.recipe.rl
    if not (is_rank_zero() and cfg.eval_every and (step + 1) % cfg.eval_every == 0):
        return 0.0
    t0 = time.time()
    rollout.hold_current_weights(step + 1)  # asynchronous: the worker's batches ahead finish first
    t1 = time.time()
    metrics.update(validate(loaded, engine, stage.tokenizer, grader, stage.run, step + 1))
    validation_s = time.time() - t1
    metrics.update(validation_s=validation_s, validation_drain_s=t1 - t0)
    return validation_s


def _checkpoint_if_due(parts: RLParts, rollout, run, cfg, step: int) -> None:
    if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
        # colocated: the engine steps aside again while the trainer's state is saved from the GPU,
        # then gets its weights back (its memory never holds both sides at once)
        with parts.turns.training():
            save_rl_checkpoint(run, step + 1, parts.trainer, parts.pool, rollout)
        if parts.turns.released and step + 1 < cfg.steps:
            parts.weights_out.push(step + 1)


# -- the loop's plumbing ------------------------------------------------------------------------
def make_pool(recipe: Recipe, tokenizer) -> RolloutPool:
    stream = PromptStream(load_rows(recipe.data.train, "rl"), tokenizer, recipe.data.prompt_template,
                          recipe.run.seed, recipe.data.shuffle, max_prompt_tokens=recipe.data.max_prompt_tokens)
    if stream.skipped_too_long:
        console.print(f"{recipe.data.train}: {stream.skipped_too_long} of "
                      f"{stream.skipped_too_long + len(stream.rows)} prompts are longer than data.max_prompt_tokens "
                      f"= {recipe.data.max_prompt_tokens} and are left out", highlight=False)
    return RolloutPool(recipe.rl, stream)


def sampling_params(ro: RolloutSection) -> SamplingParams:
    return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, logit_noise=ro.stress_logit_noise)


def validate(loaded: LoadedRecipe, engine, tokenizer, grader: Grader, run: Run, step: int) -> dict[str, float]:
    """Training-time validation through the shared evaluation path, with the rollout engine's weights."""
    from rlrecipe.eval.runner import evaluate_benchmarks

    out = evaluate_benchmarks(loaded.recipe, engine, tokenizer, grader,
                              out_dir=run.dir / "validation" / f"step_{step:07d}", model=f"{run.dir}@step{step}",
                              recipe_path=loaded.path, recipe_sha256=loaded.sha256)
    return {f"val/{name}/avg": s["avg"] for name, s in out.items()}
