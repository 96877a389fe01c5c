"""C3PO++ vs synchronous rollout on any rollout engine, same weights, same tokens trained per step.

`compare` is the measurement; `bench/run_c3po.py` runs it on the in-process engine, and
`python -m bench.c3po_compare` runs it against an SGLang-API server: a real SGLang on a GPU (where
the speed-up should show: a decode step costs about the same at any batch size) or `rlrecipe
serve` on CPU.

    python -m bench.c3po_compare --model MODEL [--prompts RL.jsonl] [--launch-cmd "rlrecipe serve {model} --host {host} --port {port}"]

The synchronous mode generates prompts_per_step x samples_per_prompt and waits for all of them;
C3PO++ generates under a token budget equal to what a first synchronous step trained; the two
modes then alternate step by step (a machine whose load drifts weighs on both alike). Between
steps the engine's weights are reloaded (same weights, next version) as after a training step: a
server flushes its prefix cache, and partial rollouts re-prefill, as they would in training.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from rlrecipe.recipe.training import RLSection
from rlrecipe.rl.pool import RolloutPool
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rollout.base import RolloutEngine
from rlrecipe.trajectory.record import SamplingParams, Trajectory

QUESTIONS = [  # used when no prompt file is given: short math questions with long-tail answers
    "What is 17 * 23?", "How many positive divisors does 360 have?", "Solve for x: 3x + 7 = 25.",
    "What is the sum of the first 50 odd numbers?", "How many primes are there below 100?",
    "What is the remainder when 2^100 is divided by 7?", "In how many ways can 8 rooks be placed on a chessboard "
    "so that none attack each other?", "What is the smallest positive integer n such that n! ends in 10 zeros?",
]


class RecordingStream:
    """A prompt stream that remembers every trajectory it hands out, so a run's lengths can be
    written down afterwards (and its schedule replayed by bench.projection.rollout)."""

    def __init__(self, stream):
        self.stream = stream
        self.handed_out: list[Trajectory] = []

    @property
    def cursor(self) -> int:
        return self.stream.cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        self.stream.cursor = value

    def next_group(self, n: int) -> list[Trajectory]:
        group = self.stream.next_group(n)
        self.handed_out += group
        return group


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def recorded_lengths(trajs: list[Trajectory]) -> list[list]:
    """[uid, group id, prompt length, response length, status, shared] per trajectory, where shared
    lists how many first response tokens it has in common with each earlier member of its group
    (an engine prefills identical sequences once: a replay needs to know which partial responses
    were identical)."""
    out, earlier = [], {}
    for t in trajs:
        group = earlier.setdefault(t.group_id, [])
        out.append([t.uid, t.group_id, len(t.prompt_ids), len(t.response_ids), t.status.value,
                    [_common_prefix(t.response_ids, o.response_ids) if o.prompt_ids == t.prompt_ids else -1
                     for o in group]])
        group.append(t)
    return out


def engine_counters(engine: RolloutEngine) -> dict:
    """The engine's cumulative work/seconds counters (in-process and simulated engines), else {}."""
    counters = getattr(engine, "counters", None)
    return counters.as_dict() if counters is not None else {}


class StepRunner:
    """Collects rollout steps of one mode through the real pool and records each: seconds, tokens
    trained, trajectories trained, and the engine's counters (and events) over the step."""

    def __init__(self, engine: RolloutEngine, cfg: RLSection, stream, params: SamplingParams, *,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine, self.params, self.clock = engine, params, clock
        self.pool = RolloutPool(cfg, stream)
        self.steps: list[dict] = []

    def step(self) -> dict:
        engine, clock = self.engine, self.clock
        events = getattr(engine, "events", None)  # the engine's own record of each prefill/step/refill, if kept
        c0, n0, t0 = engine_counters(engine), len(events or ()), clock()
        batch, stats = self.pool.collect(engine, self.params, seed=len(self.steps))
        seconds = clock() - t0
        c1 = engine_counters(engine)
        rec = {"seconds": seconds, "tokens": sum(len(t.response_ids) for t in batch), "trained": len(batch),
               "dropped": stats.dropped, "counters": {k: c1[k] - c0[k] for k in c1}}
        if events is not None:
            rec["events"] = events[n0:]
        self.steps.append(rec)
        return rec


def run_steps(engine: RolloutEngine, cfg: RLSection, stream, params: SamplingParams, n_steps: int, *,
              clock: Callable[[], float] = time.perf_counter,
              between_steps: Callable[[int], None] | None = None) -> list[dict]:
    """`n_steps` steps of one mode, one after the other (see StepRunner)."""
    runner = StepRunner(engine, cfg, stream, params, clock=clock)
    for s in range(n_steps):
        runner.step()
        if between_steps is not None:
            between_steps(s)
    return runner.steps


def coefficient_of_variation(values: list[float]) -> float:
    """Population standard deviation over mean (0 for a constant series or fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 / mean if mean else 0.0


SPLIT = ("prefill_s", "decode_s", "sample_s", "refill_s")


def summarize(sync: list[dict], c3po: list[dict]) -> dict:
    """Per-step and per-trained-token ratios, forward passes, where the seconds went, and steadiness
    (coefficient of variation over the steps) of tokens trained and step time, for two equally long
    series of steps (C3PO++'s first step, filling an empty pool, already left out)."""
    def total(steps, key):
        return sum(st[key] for st in steps)

    def counter(steps, key):
        return sum(st["counters"].get(key, 0) for st in steps)

    n = len(sync)
    sync_s, c3_s, sync_tok, c3_tok = total(sync, "seconds"), total(c3po, "seconds"), total(sync, "tokens"), total(
        c3po, "tokens")
    out = {"sync_rollout_s_per_step": sync_s / n, "c3po_rollout_s_per_step": c3_s / len(c3po),
           "tokens_per_step_sync": sync_tok / n, "tokens_per_step_c3po": c3_tok / len(c3po),
           "rollout_speedup_per_step": (sync_s / n) / (c3_s / len(c3po)),
           "rollout_speedup_per_trained_token": (c3_tok / c3_s) / (sync_tok / sync_s)}
    sync_fw, c3_fw = counter(sync, "forward_passes"), counter(c3po, "forward_passes")
    if sync_fw and c3_fw:
        # forward passes per trained token: what a rollout costs where decoding is memory-bound
        out.update({"sync_forward_passes_per_step": sync_fw / n, "c3po_forward_passes_per_step": c3_fw / len(c3po),
                    "forward_pass_ratio_per_trained_token": (sync_fw / sync_tok) / (c3_fw / c3_tok)})
    for mode, steps, secs in (("sync", sync, sync_s), ("c3po", c3po, c3_s)):
        if counter(steps, "generate_s"):
            parts = {k: counter(steps, k) for k in SPLIT}
            for k, v in parts.items():  # shares of the rollout seconds; "other": the pool, python, waiting
                out[f"{mode}_share_{k[:-2]}"] = v / secs
            out[f"{mode}_share_other"] = 1 - sum(parts.values()) / secs
            out[f"{mode}_reprefilled_tokens_per_step"] = counter(steps, "reprefill_tokens") / len(steps)
    for mode, steps in (("sync", sync), ("c3po", c3po)):
        out[f"{mode}_cv_tokens_per_step"] = coefficient_of_variation([st["tokens"] for st in steps])
        out[f"{mode}_cv_step_s"] = coefficient_of_variation([st["seconds"] for st in steps])
    return out


def compare(engine: RolloutEngine, rows: list[dict], tokenizer, template: str, params: SamplingParams, *,
            steps: int, prompts_per_step: int, samples_per_prompt: int, pool_capacity: int, max_staleness: int = 2,
            refill: str = "per_call", surplus: str = "carry",
            between_steps: Callable[[int], None] | None = None) -> dict:
    """Rollout time per step and per trained token, synchronous vs C3PO++ (steady state)."""
    return compare_streams(engine, lambda: PromptStream(rows, tokenizer, template, seed=0), params, steps=steps,
                           prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                           pool_capacity=pool_capacity, max_staleness=max_staleness, refill=refill,
                           surplus=surplus, between_steps=between_steps)


def _trace_settings(engine: RolloutEngine, params: SamplingParams, **schedule) -> dict:
    """A trace's settings: the schedule compared (keyword order kept), then how the engine batches."""
    return {**schedule, "max_new_tokens": params.max_new_tokens,
            "max_batch": getattr(engine, "max_batch", None),
            "refill_fraction": getattr(engine, "refill_fraction", None),
            # how the engine batches: the in-process engine's slots, or a server's
            # continuous batching (see bench.projection.sim.SimEngine)
            "layout": getattr(engine, "layout", "inprocess" if hasattr(engine, "counters") else "server")}


def compare_streams(engine: RolloutEngine, make_stream: Callable[[], object], params: SamplingParams, *,
                    steps: int, prompts_per_step: int, samples_per_prompt: int, pool_capacity: int,
                    max_staleness: int = 2, refill: str = "per_call", surplus: str = "carry",
                    between_steps: Callable[[int], None] | None = None, clock: Callable[[], float] = time.perf_counter) -> dict:
    """`compare` over any prompt stream (each mode gets a fresh one from `make_stream`).

    Each mode runs one uncounted step first (the synchronous one sets C3PO++'s token budget; C3PO++'s
    fills its empty pool), then the modes alternate step by step, `steps` each.

    The result also holds `trace`: the settings, every step's seconds/tokens/counters (the first
    ones too, marked warmup) and every trajectory's prompt and response length, enough for
    bench.projection.rollout to replay both schedules and to calibrate a cost model from them.
    """
    trace = {"settings": _trace_settings(engine, params, steps=steps, prompts_per_step=prompts_per_step,
                                         samples_per_prompt=samples_per_prompt, pool_capacity=pool_capacity,
                                         max_staleness=max_staleness, refill=refill, surplus=surplus),
             "steps": {}, "trajectories": {}}
    if hasattr(engine, "events") and engine.events is None:
        engine.events = []  # keep the engine's events for the run (calibration one event at a time)
    common = {"prompts_per_step": prompts_per_step, "samples_per_prompt": samples_per_prompt}
    streams = {mode: RecordingStream(make_stream()) for mode in ("sync", "c3po")}
    pushes = 0

    def step(runner: StepRunner, warmup: bool = False) -> dict:
        nonlocal pushes
        rec = runner.step()
        if warmup:
            rec["warmup"] = True
        if between_steps is not None:
            between_steps(pushes)
            pushes += 1
        return rec

    sync = StepRunner(engine, RLSection(**common, c3po={"enabled": False}), streams["sync"], params, clock=clock)
    # a first synchronous step (not counted) sets C3PO++'s budget: the tokens one synchronous step trains
    budget = max(1, step(sync, warmup=True)["tokens"])
    trace["settings"]["token_budget"] = budget
    c3po = StepRunner(engine, RLSection(**common, c3po={"enabled": True, "token_budget": budget, "refill": refill,
                                                        "surplus": surplus, "pool_capacity": pool_capacity,
                                                        "max_staleness": max_staleness}),
                      streams["c3po"], params, clock=clock)
    step(c3po, warmup=True)  # C3PO++'s first step fills an empty pool; steady state after it
    for _ in range(steps):  # alternating, so a machine whose load drifts weighs on both modes alike
        step(sync)
        step(c3po)
    for mode, runner in (("sync", sync), ("c3po", c3po)):
        trace["steps"][mode] = runner.steps
        trace["trajectories"][mode] = recorded_lengths(streams[mode].handed_out)
    out = summarize(sync.steps[1:], c3po.steps[1:])
    out["token_budget"] = budget
    # how far past the budget C3PO++'s steps trained: rollouts that finish on the decoding step
    # that crosses it all count, so a cohort of alike lengths finishing together overshoots
    over = [st["tokens"] / budget - 1 for st in c3po.steps[1:]]
    out["c3po_over_budget_mean"], out["c3po_over_budget_max"] = sum(over) / len(over), max(over)
    out["trace"] = trace
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory or hub id (the server loads it)")
    ap.add_argument("--prompts", help="an RL JSONL file (rows with id, prompt, answers); default: built-in questions")
    ap.add_argument("--template", default="r1", help="prompt template (rlrecipe.data.templates): r1 or plain")
    ap.add_argument("--launch-cmd", help="replaces `python -m sglang.launch_server` ({model} {host} {port} ...)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--pool-capacity", type=int, default=0, help="default: 1.25 x one synchronous batch")
    ap.add_argument("--refill", choices=("per_call", "continuous"), default="per_call",
                    help="rl.c3po.refill: new prompts enter the pool before each generate call, or as rollouts finish")
    ap.add_argument("--surplus", choices=("carry", "train"), default="carry",
                    help="rl.c3po.surplus: finished rollouts past the budget train next step, or this one")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="bench/c3po_server.json")
    args = ap.parse_args(argv)

    from rlrecipe.data.io import load_rows
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.recipe.systems import SGLangServer
    from rlrecipe.rollout.sglang.engine import SGLangEngine

    tok = load_tokenizer(args.model)
    rows = (load_rows(args.prompts, "rl") if args.prompts else
            [{"id": f"q{i}", "prompt": q, "answers": ["0"]} for i, q in enumerate(QUESTIONS)])
    cfg = SGLangServer(base_port=args.port, startup_timeout_s=900,
                       launch_cmd=shlex.split(args.launch_cmd) if args.launch_cmd else [])
    capacity = args.pool_capacity or int(1.25 * args.prompts_per_step * args.samples_per_prompt)
    engine = SGLangEngine.launch(args.model, cfg=cfg, dtype=args.dtype, eos_token_id=tok.eos_token_id)
    try:
        def reload(step: int) -> None:
            engine.update_weights_from_disk(args.model, step + 1)

        result = compare(engine, rows, tok, args.template,
                         SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens),
                         steps=args.steps, prompts_per_step=args.prompts_per_step,
                         samples_per_prompt=args.samples_per_prompt, pool_capacity=capacity, refill=args.refill,
                         surplus=args.surplus, between_steps=reload)
    finally:
        engine.close()
    result.update(model=args.model, server="sglang" if not args.launch_cmd else args.launch_cmd.split()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}), flush=True)
    print(f"written to {args.out} (with per-step timings and lengths: python -m bench.projection.rollout "
          f"{args.out} --calibrate calibrates a cost model from it)", flush=True)
    return result


if __name__ == "__main__":
    main()
