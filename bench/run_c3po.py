"""`make bench`'s C3PO++ benchmarks: C3PO++ vs synchronous rollout measured on the in-process
engine (a step's rollout, its first prefill, whole RL steps), the measured schedules replayed and
projected by cost models (bench/projection/rollout.py), the shipped 7B recipe projected, and the
table that sets them side by side.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.table import Table

from bench.c3po_compare import compare
from bench.inputs import DATA, MODEL
from rlrecipe.data.io import load_rows
from rlrecipe.modeling import load_tokenizer
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.trajectory.record import SamplingParams


def bench_c3po(steps: int = 6, surplus: str = "carry") -> dict:
    """Synchronous batches vs C3PO++ with the same tokens trained per step (same weights; between
    steps the weights are pushed again under the next version, so partial rollouts re-prefill as
    in training). Also: where each mode's rollout seconds go, and steadiness over the steps.
    `surplus`: rl.c3po.surplus (`train` gives the behaviour before finished rollouts past the
    budget were carried to the next step)."""
    tok = load_tokenizer(MODEL)
    engine = InProcessEngine(MODEL, tok.eos_token_id, tok.pad_token_id, dtype="bfloat16", max_batch=1024)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    return compare(engine, load_rows(str(DATA / "rl.jsonl"), "rl"), tok, "plain",
                   SamplingParams(temperature=1.0, max_new_tokens=160), steps=steps, prompts_per_step=64,
                   samples_per_prompt=8, pool_capacity=1024, surplus=surplus,
                   between_steps=lambda s: engine.update_weights_from_state(state, s + 1))


def bench_prefill(budget: int = 25_000, repeats: int = 3) -> dict:
    """Packed vs left-padded prefill (same engine, same rows, alternating): of what a C3PO++ step
    prefills first after a weight update (the pool's unfinished rollouts, prompt + partial
    response, plus fresh groups up to capacity; settings of bench_c3po, two steps in), and of a
    synchronous step's fresh prompts (8 samples of each)."""
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.rl.pool import RolloutPool
    from rlrecipe.rl.prompts import PromptStream

    tok = load_tokenizer(MODEL)
    engine = InProcessEngine(MODEL, tok.eos_token_id, tok.pad_token_id, dtype="bfloat16", max_batch=1024)
    rows = load_rows(str(DATA / "rl.jsonl"), "rl")
    cfg = RLSection(prompts_per_step=64, samples_per_prompt=8,
                    c3po={"enabled": True, "token_budget": budget, "pool_capacity": 1024, "max_staleness": 2})
    pool = RolloutPool(cfg, PromptStream(rows, tok, "plain", seed=0))
    for step in range(2):
        pool.collect(engine, SamplingParams(temperature=1.0, max_new_tokens=160), seed=step)
    resume = list(pool.in_flight)
    while len(resume) + 8 <= 1024:
        resume += pool.stream.next_group(8)
    stream = PromptStream(rows, tok, "plain", seed=1)
    fresh = [t for _ in range(64) for t in stream.next_group(8)]
    out = {}
    for name, batch in (("c3po_resume", resume[:1024]), ("sync_fresh", fresh)):
        lens = [t.num_tokens for t in batch]
        times = {"packed": 0.0, "padded": 0.0}
        for r in range(repeats + 1):  # the first round warms up
            for mode in times:
                engine.packed_prefill = mode == "packed"
                t0 = time.perf_counter()
                engine._prefill(batch)
                if r:
                    times[mode] += time.perf_counter() - t0
        out.update({f"{name}_rows": len(batch), f"{name}_resumed_rows": sum(bool(t.response_ids) for t in batch),
                    f"{name}_real_tokens": sum(lens), f"{name}_padded_tokens": len(batch) * max(lens),
                    f"{name}_distinct_tokens": sum(len(q) for q in {tuple(t.prompt_ids + t.response_ids)
                                                                    for t in batch}),
                    f"{name}_packed_s": times["packed"] / repeats, f"{name}_padded_s": times["padded"] / repeats,
                    f"{name}_packed_speedup": times["padded"] / times["packed"]})
    return out


def bench_c3po_end_to_end(steps: int = 5) -> dict:
    """Whole RL steps (rollout + grading + training + weight push) with tiny_rl.yaml, C3PO++ on vs off.

    Four runs in the order sync, C3PO++, C3PO++, sync: a whole run cannot alternate with the other
    step by step, and this machine drifts between speeds for minutes (one bench run found C3PO++'s
    training 30% slower a token than sync's when the two ran one after the other); the mirrored
    order cancels a steady drift, and the two pairs' ratios show what is left."""
    from rlrecipe.recipe.schema import load_recipe
    from rlrecipe.stages.rl import run_rl

    runs: list[tuple[str, list[dict]]] = []
    for i, mode in enumerate(("sync", "c3po", "c3po", "sync")):
        loaded = load_recipe("recipes/tiny_rl.yaml", [
            f"run.name=bench-rl-{mode}-{i}", f"run.init_from={MODEL}", f"rl.steps={steps}", "eval.benchmarks=[]",
            f"rl.c3po.enabled={str(mode == 'c3po').lower()}", "run.output_dir=.cache/bench-runs"])
        run_rl(loaded, overwrite=True)  # the bench's own scratch runs
        rows = [json.loads(line) for line in
                (Path(".cache/bench-runs") / f"bench-rl-{mode}-{i}" / "metrics.jsonl").read_text().splitlines()]
        rows = rows[1:]  # the first C3PO++ step fills an empty pool
        runs.append((mode, [{k: r[k] for k in ("rollout_s", "grade_s", "train_s", "tokens_trained")} for r in rows]))

    def per_token(rows: list[dict], grading: bool = True) -> float:
        seconds = sum(r["rollout_s"] + r["train_s"] - (0 if grading else r["grade_s"]) for r in rows)
        return seconds / sum(r["tokens_trained"] for r in rows)

    steps_kept = {mode: [r for m, rows in runs if m == mode for r in rows] for mode in ("sync", "c3po")}
    pair_ratios = [per_token(runs[a][1]) / per_token(runs[b][1]) for a, b in ((0, 1), (3, 2))]
    # Beside it, without grading (part of rollout_s): a run's grading workers start when its first
    # answer misses the fast path (~0.6 s each), in whichever counted step that happens to be, and
    # on tiny-arith that is a matter of which samples came out, not of the rollout mode.
    return {"sync_s_per_1k_trained_tokens": 1000 * per_token(steps_kept["sync"]),
            "c3po_s_per_1k_trained_tokens": 1000 * per_token(steps_kept["c3po"]),
            "end_to_end_speedup": per_token(steps_kept["sync"]) / per_token(steps_kept["c3po"]),
            "end_to_end_speedup_first_pair": pair_ratios[0], "end_to_end_speedup_second_pair": pair_ratios[1],
            "end_to_end_speedup_without_grading": per_token(steps_kept["sync"], False)
            / per_token(steps_kept["c3po"], False),
            "grade_s_sync": sum(r["grade_s"] for r in steps_kept["sync"]),
            "grade_s_c3po": sum(r["grade_s"] for r in steps_kept["c3po"]),
            "steps": steps_kept}


def bench_projection(c3po: dict, end_to_end: dict | None) -> dict:
    """The measured C3PO++ run's schedules timed by cost models (bench/projection/rollout.py):
    calibrated on this CPU run (a check of the simulator: it should give back the measured
    ratio), and projected to a GPU (bench/cost_model.json if present, e.g. calibrated from
    `make bench-sglang`; else the default, an ASSUMPTION)."""
    from dataclasses import replace

    from bench.projection.calibration import calibrate, fit_train_model
    from bench.projection.rollout import gpu_cost_model, project

    trace = c3po["trace"]
    out: dict = {}
    train = (0.0, 0.0)
    if end_to_end:  # the CPU train-time model: train_s of the end-to-end runs against tokens trained
        train = fit_train_model(end_to_end["steps"]["sync"] + end_to_end["steps"]["c3po"])
        out["cpu_train_step_s"], out["cpu_train_ms_per_1k_tokens"] = train[0], 1e6 * train[1]
    for by in ("events", "components", "total"):
        cost, check = calibrate(trace, by=by, layout="inprocess")
        cost = replace(cost, train_step_s=train[0], train_token_s=train[1])
        out[f"cpu_{by}"] = {**project(trace, cost, layout="inprocess"), **check,
                            **{k: v for k, v in vars(cost).items() if k != "label"}}
    gpu, out["gpu_cost_model"] = gpu_cost_model()
    out["gpu"] = project(trace, gpu, layout="server")
    return out


# The shipped C3PO++ recipe, projected at reasoning lengths (docs/performance.md, "C3PO++ at the 7B recipe's size")
RECIPE_PROJECTED = "recipes/7b_boba_icepop_c3po.yaml"
ASSUMED_LENGTHS = (10_000, 0.4, 0.45)  # log-normal median, prompt and sample sigma: an assumption


def bench_recipe_projection() -> dict:
    """The 7B C3PO++ recipe's own settings (one rollout engine's share of a step, its KV cache as
    `rlrecipe plan` sizes it) under the GPU cost model, over assumed log-normal lengths: the
    projection `make bench` keeps current."""
    from bench.projection.rollout import (
        gpu_cost_model,
        lognormal_groups,
        lognormal_label,
        project,
        recipe_trace,
    )
    from rlrecipe.checks.plan import kv_cache_tokens
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(RECIPE_PROJECTED)
    trace = recipe_trace(loaded.recipe, kv_tokens=kv_cache_tokens(loaded))
    s = trace["settings"]
    cost, cost_name = gpu_cost_model()
    groups = lognormal_groups(*ASSUMED_LENGTHS, s["samples_per_prompt"], s["max_new_tokens"])
    return {"recipe": RECIPE_PROJECTED, "cost_model": cost_name,
            "lengths": lognormal_label(*ASSUMED_LENGTHS, s["max_new_tokens"]), **project(trace, cost, groups=groups)}


def c3po_table(results: dict) -> Table:
    """C3PO++ vs synchronous: measured on this CPU beside the replayed and projected numbers."""
    m, p = results["c3po_vs_sync"], results["c3po_projection"]
    e2e = results.get("c3po_vs_sync_end_to_end", {})
    # measured: the engine's own split (decoding steps counted with their sampling, as the
    # replays' cost model counts them); "other" is the pool and python between phases
    for mode in ("sync", "c3po"):
        if f"{mode}_share_decode" in m:
            m = {**m, f"{mode}_share_decode": m[f"{mode}_share_decode"] + m[f"{mode}_share_sample"]}
    cols = [("measured (this CPU)", m), ("replay, fit per event", p["cpu_events"]),
            ("replay, fit to step totals", p["cpu_total"]), ("projected GPU", p["gpu"])]
    table = Table(title=f"C3PO++ vs synchronous rollout, same tokens per step; projected GPU: {p['gpu_cost_model']}")
    table.add_column("measure")
    for name, _ in cols:
        table.add_column(name, justify="right")
    rows = [("speed-up per step", ("rollout_speedup_per_step", "speedup_per_step")),
            ("speed-up per trained token", ("rollout_speedup_per_trained_token", "speedup_per_trained_token")),
            ("end to end speed-up per trained token", ("end_to_end_speedup_per_trained_token",)),
            ("forward passes per trained token, sync / C3PO++", ("forward_pass_ratio_per_trained_token",)),
            ("sync rollout s/step", ("sync_rollout_s_per_step", "sync_s_per_step")),
            ("C3PO++ rollout s/step", ("c3po_rollout_s_per_step", "c3po_s_per_step")),
            ("C3PO++ share prefill", ("c3po_share_prefill",)),
            ("C3PO++ share decoding steps (with sampling)", ("c3po_share_decode",)),
            ("C3PO++ share refill (cache joins)", ("c3po_share_refill",)), ("C3PO++ share other", ("c3po_share_other",)),
            ("sync share prefill", ("sync_share_prefill",)),
            ("sync share decoding steps (with sampling)", ("sync_share_decode",)),
            ("CV tokens/step sync", ("sync_cv_tokens_per_step",)), ("CV tokens/step C3PO++", ("c3po_cv_tokens_per_step",)),
            ("CV step time sync", ("sync_cv_step_s",)), ("CV step time C3PO++", ("c3po_cv_step_s",)),
            ("fit: R^2 of measured step seconds", ("r2_step_seconds",)),
            ("fit: condition number (decode, or all)", ("condition_number_decode", "condition_number"))]
    for label, keys in rows:
        cells = []
        for name, vals in cols:
            v = next((vals[k] for k in keys if k in vals), None)
            if v is None and name.startswith("measured") and keys[0] == "end_to_end_speedup_per_trained_token":
                v = e2e.get("end_to_end_speedup")  # tiny_rl.yaml's own settings, not this schedule
            cells.append("" if v is None else f"{v:.3f}")
        table.add_row(label, *cells)
    table.caption = ("measured: wall seconds on this machine, the two modes alternating step by step; replays: the same "
                     "schedules (every trajectory's recorded length, the real pool) timed by a cost model fitted "
                     "to this run's events or step totals; projected GPU: the same lengths under continuous "
                     "batching, timed by the cost model named above. Measured end to end: tiny_rl.yaml's settings.")
    return table
