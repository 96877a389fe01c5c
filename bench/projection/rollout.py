"""C3PO++ vs synchronous rollout projected to a device where it matters, from a measured run.

On a GPU a decoding step costs about the same at batch 8 and batch 256 (reading the weights
dominates), so a synchronous step that waits for its longest rollouts wastes the device; on the
CPUs `make bench` runs on, a step's cost grows with its batch, and that waste is small. This
module times the same rollout schedules with an explicit device cost model instead of a device:

- `CostModel` (bench/projection/sim.py): seconds of a decoding step as a function of its batch and the
  context it attends to, seconds of prefill per token, and (for the end to end figure) of training
  per token. The default is an ASSUMPTION (a 7B model in bf16 on one H100, derived below),
  loadable from JSON.
- `SimEngine` (bench/projection/sim.py): a `RolloutEngine` with the real `generate()` contract (token
  budget, partial rollouts resuming, continuous batching over `max_batch` slots with refill) whose
  rows take the lengths of a real run, and which advances a clock by the cost model instead of
  computing.
- `project`: the real pool logic (`RolloutPool`) run over it, synchronous and C3PO++ at the same
  tokens per step, replaying a run that `bench.c3po_compare` recorded (every trajectory's prompt
  and response length): seconds per step and per trained token, speed-ups, where the seconds go.
- `calibrate` (bench/projection/calibration.py): least-squares (non-negative) fit of the cost model from
  the measured per-step seconds of such a run against the simulator's features for the same
  schedule: from `make bench-sglang` output on a GPU, or from `make bench` on CPU, where the
  calibrated projection should come back to the measured CPU ratio (a check of the simulator).

    python -m bench.projection.rollout bench/c3po_server.json [--cost cost.json] [--calibrate] [--save-cost out.json]

- `--recipe`: a recipe's own settings before it runs (`recipe_trace`: one rollout engine's share of a
  step), over response lengths from a file or an assumed log-normal (`lognormal_groups`):

    python -m bench.projection.rollout --recipe recipes/7b_boba_icepop_c3po.yaml --lognormal 10000,0.4,0.45
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from bench.c3po_compare import coefficient_of_variation
from bench.projection.calibration import calibrate
from bench.projection.cost_model import dims_of, gpu_cost
from bench.projection.sim import (
    CostModel,
    simulate,
)
from rlrecipe.checks.gpu_costs import DEVICES


def _fitted_7b() -> CostModel:
    cfg = Path(__file__).parents[2] / "rlrecipe" / "model_configs" / "deepseek-ai__DeepSeek-R1-Distill-Qwen-7B.json"
    return gpu_cost(dims_of(json.loads(cfg.read_text())), DEVICES["H100"], train_seq_len=256 + 10000)


# The former default, an ASSUMPTION: Qwen2.5-7B-like (N = 7.6e9 parameters, 28 layers, 4 KV heads of 128)
# in bf16 on one H100 SXM (HBM3 3.35 TB/s, about 2.6 TB/s reached; 989 dense bf16 TFLOP/s), served
# with continuous batching over a paged KV cache.
# - step_s: a decoding step reads the 15.2 GB of weights once: 15.2e9 B / 2.6e12 B/s = 5.8 ms, plus
#   about 1.2 ms of scheduling, sampling and launches: 7 ms whatever the batch.
# - row_s: each row adds 2N = 15.2 GFLOP (15.4 us at peak). The GEMMs of a large decoding batch
#   reach ~75% of peak and overlap the weight read, so ~20 us per row above the floor; linear in
#   the batch, this overstates mid-size batches, which understates C3PO++'s gain.
# - ctx_s: each context token's K and V: 2 x 28 x 4 x 128 x 2 B = 57 KB read per step:
#   57,344 B / 2.6e12 B/s = 22 ns.
# - prefill_token_s: the same 2N FLOP per token at ~70% of peak (large GEMMs; attention is small
#   at these lengths): 15.2e9 / 6.9e14 = 22 us; prefill_call_s: 2 ms per prefill batch (one
#   scheduler iteration). So re-prefilling a resumed rollout costs about what decoding its
#   tokens cost above the floor: C3PO++ pays it after every weight update.
# - prefill_cell_s, refill_cell_s: 0, a paged KV cache is written in place, never re-laid out.
# - train_token_s: 8N FLOP per trained token (6N forward and backward, 2N recomputing the old
#   log-probs) at 40% of peak: 6.1e10 / 4.0e14 = 150 us; train_step_s: 3 s per step for the
#   optimizer step; push_s: 2 s for pushing 15 GB of weights to the rollout engine (the async
#   projection replaces it with bench.projection.push's model).
H100_7B_ASSUMED = CostModel(
    step_s=7.0e-3, row_s=2.0e-5, ctx_s=2.2e-8, prefill_call_s=2.0e-3, prefill_token_s=2.2e-5, prefill_cell_s=0.0,
    refill_cell_s=0.0,
    train_step_s=3.0, train_token_s=1.5e-4, push_s=2.0,
    label="ASSUMPTION: 7B model, bf16, one H100 SXM, continuous batching, paged KV (bench/projection/rollout.py)")

# The default: the same terms, each a roofline term over a share of the H100's datasheet peak fitted to published
# measurements (bench/projection/cost_model.py: DECODE_SHARE from SGLang's Llama 3.1 8B figures, TRAIN_SHARE from
# torchtitan's Llama 3.1 8B FSDP figures; `python -m bench.projection.published` predicts every case). Trained
# tokens are costed at a 10,256-token sequence: a 256-token prompt and the 10,000-token median response the
# projections assume. H100_7B_ASSUMED above, the hand-derived model it replaces, is kept for the tests that pin
# the simulator's figures under it and for comparing the two.
H100_7B_FITTED = _fitted_7b()


def _steady(steps: list[dict]) -> list[dict]:
    return [s for s in steps if not s.get("warmup")]


def report(steps: dict[str, list[dict]], cost: CostModel) -> dict:
    """Seconds per step and per trained token, speed-ups (rollout, and end to end with the train
    model), where the rollout seconds go, and steadiness, from per-step records of both modes."""
    out = {}
    per = {}
    for mode in ("sync", "c3po"):
        st = _steady(steps[mode])
        secs, tokens = sum(s["seconds"] for s in st), sum(s["tokens"] for s in st)
        train = len(st) * (cost.train_step_s + cost.push_s) + cost.train_token_s * tokens
        per[mode] = (secs / len(st), secs / tokens, (secs + train) / tokens)
        out[f"{mode}_s_per_step"] = secs / len(st)
        out[f"{mode}_ms_per_1k_trained_tokens"] = 1e6 * secs / tokens
        c = {k: sum(s["counters"].get(k, 0) for s in st) for k in ("prefill_s", "decode_s", "refill_s")}
        for k, v in c.items():
            out[f"{mode}_share_{k[:-2]}"] = v / secs if secs else 0.0
        rows, dsteps, prefilled = (sum(s["counters"].get(k, 0) for s in st)
                                   for k in ("decode_rows", "decode_steps", "prefill_rows"))
        # tokens generated (each prefilled row's first token, then one per row and decoding step) per
        # token trained: > 1 is work dropped with stale rollouts or still in flight at the end, < 1
        # tokens trained that were generated before the first step counted; and rows per decoding
        # step, how full the device is kept
        out[f"{mode}_generated_per_trained_token"] = (rows + prefilled) / tokens if tokens else 0.0
        out[f"{mode}_mean_decode_batch"] = rows / dsteps if dsteps else 0.0
        # rollouts dropped as too stale (C3PO++'s sigma), per rollout trained or dropped: work lost,
        # and the longest responses missing from training; and the mean length of those trained
        trained, dropped = sum(s["trained"] for s in st), sum(s.get("dropped", 0) for s in st)
        out[f"{mode}_dropped_share"] = dropped / (trained + dropped) if trained + dropped else 0.0
        out[f"{mode}_mean_trained_length"] = tokens / trained if trained else 0.0
        # rows a server preempted for KV-cache room (each prefilled again later), per step
        out[f"{mode}_retracted_per_step"] = sum(s["counters"].get("retracted_rows", 0) for s in st) / len(st)
        out[f"{mode}_cv_tokens_per_step"] = coefficient_of_variation([s["tokens"] for s in st])
        out[f"{mode}_cv_step_s"] = coefficient_of_variation([s["seconds"] for s in st])
    out["speedup_per_step"] = per["sync"][0] / per["c3po"][0]
    out["speedup_per_trained_token"] = per["sync"][1] / per["c3po"][1]
    if cost.train_step_s or cost.train_token_s:
        out["end_to_end_speedup_per_trained_token"] = per["sync"][2] / per["c3po"][2]
    return out


def project(trace: dict, cost: CostModel, **kw) -> dict:
    """`report` of `simulate`: the projection of a recorded run under `cost`."""
    return report(simulate(trace, cost, **kw), cost)


# -- a recipe's settings, projected before it runs ---------------------------------------------
def recipe_trace(recipe, *, steps: int = 5, max_batch: int | None = None, prompt_len: int = 256,
                 kv_tokens: int | None = None, kv_reserve: float = 0.0) -> dict:
    """A `simulate` input (settings, no recorded trajectories) for one rollout engine's share of a
    recipe's step: prompts per step, C3PO++ pool capacity and token budget divided by the number of
    engines (servers x dp, or rollout.urls), its staleness and max_new_tokens as they are; with
    `kv_tokens` (`rlrecipe.checks.plan.kv_cache_tokens`), the engine's KV cache bounds what it runs at once."""
    from rlrecipe.checks.plan import rollout_engines

    ro, rl = recipe.rollout, recipe.rl
    engines = rollout_engines(recipe)
    prompts = max(1, round(rl.prompts_per_step / engines))
    rows = prompts * rl.samples_per_prompt
    pool = max(rl.samples_per_prompt, round(rl.c3po.pool_capacity / engines))
    return {"settings": {"steps": steps, "prompts_per_step": prompts, "samples_per_prompt": rl.samples_per_prompt,
                         "pool_capacity": pool, "max_staleness": rl.c3po.max_staleness, "refill": rl.c3po.refill,
                         "surplus": rl.c3po.surplus,
                         "token_budget": max(1, round(rl.c3po.token_budget / engines)),
                         "max_new_tokens": ro.max_new_tokens, "max_batch": max_batch or max(rows, pool),
                         "refill_fraction": 0.25, "layout": "server", "engines": engines, "prompt_len": prompt_len,
                         "kv_tokens": kv_tokens, "kv_reserve": kv_reserve},
            "trajectories": {"sync": [], "c3po": []}}


def lognormal_groups(median: float, prompt_sigma: float, sample_sigma: float, samples: int, max_new_tokens: int,
                     n_groups: int = 4096, seed: int = 0) -> list[list[int]]:
    """Response lengths, one list per prompt: a prompt's median is `median` x exp(N(0, prompt_sigma))
    (some prompts are harder), each sample log-normal around it with `sample_sigma`; lengths past
    max_new_tokens are cut there (truncated rollouts). An assumption to state, not a measurement."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        mu = math.log(median) + rng.gauss(0.0, prompt_sigma)
        out.append([max(1, min(max_new_tokens, round(rng.lognormvariate(mu, sample_sigma)))) for _ in range(samples)])
    return out


def lognormal_label(median: float, prompt_sigma: float, sample_sigma: float, max_new_tokens: int) -> str:
    """How results name the lengths `lognormal_groups` drew: an assumption."""
    return (f"ASSUMPTION: log-normal, median {median:g}, prompt sigma {prompt_sigma:g}, sample sigma {sample_sigma:g}, "
            f"cut at {max_new_tokens}")


def gpu_cost_model(path: str | Path = "bench/cost_model.json") -> tuple[CostModel, str]:
    """The GPU cost model and its name: fitted by `make bench-sglang` when it has run, else the
    H100 model fitted to published measurements (H100_7B_FITTED)."""
    path = Path(path)
    cost = CostModel.from_json(path) if path.exists() else H100_7B_FITTED
    return cost, cost.label or str(path)


def measured_ratio(trace: dict) -> float:
    """Measured s/trained-token, sync over C3PO++, from the recorded steps."""
    def per_token(steps):
        st = _steady(steps)
        return sum(s["seconds"] for s in st) / sum(s["tokens"] for s in st)
    return per_token(trace["steps"]["sync"]) / per_token(trace["steps"]["c3po"])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", help="a bench.c3po_compare result with its trace (bench/c3po_server.json, or "
                                           "bench/results.json's c3po_vs_sync)")
    ap.add_argument("--recipe", help="instead of a run: this recipe's settings, one rollout engine's share of a "
                                     "step (needs --lengths or --lognormal)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    ap.add_argument("--lognormal", metavar="MEDIAN,PROMPT_SIGMA,SAMPLE_SIGMA",
                    help="draw response lengths from this assumed distribution (see lognormal_groups)")
    ap.add_argument("--steps", type=int, default=5, help="steps projected after the first (--recipe)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (--recipe)")
    ap.add_argument("--cost", help="cost model JSON (CostModel fields); default: the H100 / 7B model fitted to published figures")
    ap.add_argument("--calibrate", action="store_true", help="fit the cost model to this run's step times first")
    ap.add_argument("--by", default="total", choices=("total", "components", "events"))
    ap.add_argument("--params", help="comma-separated parameters to fit (default: all); the others keep the "
                                     "values of --cost (or of the default assumption)")
    ap.add_argument("--save-cost", help="write the (calibrated) cost model here")
    ap.add_argument("--layout", choices=("server", "inprocess"), help="default: the recorded engine's")
    ap.add_argument("--max-batch", type=int, help="slots of the projected engine; default: the recorded engine's "
                                                  "(--recipe: every rollout of its share at once)")
    ap.add_argument("--lengths", help="JSON list of response lengths (or of lists, one per prompt) to draw from "
                                      "instead of replaying the run's")
    ap.add_argument("--kv-tokens", type=int, help="a server's KV cache in tokens (0: unbounded); default: "
                                                  "--recipe's from rlrecipe plan, a recorded run's none")
    ap.add_argument("--kv-reserve", type=float, default=0.0,
                    help="share of each admitted row's tokens to come (at most 4,096) kept free in the KV cache "
                         "(SGLang's new_token_ratio, about 0.1 to 0.7); default 0")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    if (args.run is None) == (args.recipe is None):
        ap.error("give a recorded run or --recipe, one of them")
    cost = CostModel.from_json(args.cost) if args.cost else H100_7B_FITTED
    out: dict = {}
    if args.recipe:
        if args.calibrate or not (args.lengths or args.lognormal):
            ap.error("--recipe projects lengths given by --lengths or --lognormal, and has no run to calibrate on")
        from rlrecipe.checks.plan import kv_cache_tokens
        from rlrecipe.recipe.schema import load_recipe

        loaded = load_recipe(args.recipe, args.set)
        kv = kv_cache_tokens(loaded) if args.kv_tokens is None else args.kv_tokens or None
        trace = recipe_trace(loaded.recipe, steps=args.steps, max_batch=args.max_batch, prompt_len=args.prompt_len,
                             kv_tokens=kv, kv_reserve=args.kv_reserve)
        out["settings"] = trace["settings"]
    else:
        data = json.loads(Path(args.run).read_text())
        trace = data.get("trace") or data.get("c3po_vs_sync", {}).get("trace")
        if trace is None:
            raise SystemExit(f"{args.run}: no trace (per-step timings and lengths); rerun bench.c3po_compare")
    if args.calibrate:
        params = tuple(args.params.split(",")) if args.params else None
        fitted, check = calibrate(trace, by=args.by, layout=args.layout, params=params,
                                  held=cost if params else None)
        source = data.get("model") or data.get("c3po_vs_sync", {}).get("model") or ""
        cost = replace(fitted, train_step_s=cost.train_step_s, train_token_s=cost.train_token_s, push_s=cost.push_s,
                       label=f"{fitted.label}: {args.run} {source}; train model from "
                             f"{args.cost or 'the default assumption'}")
        out["calibration"] = {**asdict(fitted), **check}
    if args.run and args.kv_tokens:
        trace["settings"].update(kv_tokens=args.kv_tokens, kv_reserve=args.kv_reserve)
    groups = json.loads(Path(args.lengths).read_text()) if args.lengths else None
    if args.lognormal:
        median, prompt_sigma, sample_sigma = (float(x) for x in args.lognormal.split(","))
        settings = trace["settings"]
        groups = lognormal_groups(median, prompt_sigma, sample_sigma, settings["samples_per_prompt"],
                                  settings["max_new_tokens"])
        out["lengths"] = lognormal_label(median, prompt_sigma, sample_sigma, settings["max_new_tokens"])
    out["cost_model"] = cost.label
    out["projected"] = project(trace, cost, layout=args.layout, max_batch=args.max_batch, groups=groups)
    if args.run:
        out["measured_speedup_per_trained_token"] = measured_ratio(trace)
    if args.save_cost:
        cost.to_json(args.save_cost)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
