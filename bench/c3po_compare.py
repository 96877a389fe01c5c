"""C3PO++ vs synchronous rollout on any rollout engine, same weights, same tokens trained per step.

`compare` is the measurement; `bench/run.py` runs it on the in-process engine, and
`python -m bench.c3po_compare` runs it against an SGLang-API server: a real SGLang on a GPU (where
the speed-up should show: a decode step costs about the same at any batch size) or `rlrecipe
serve` on CPU.

    python -m bench.c3po_compare --model MODEL [--prompts RL.jsonl] [--launch-cmd "rlrecipe serve {model} --host {host} --port {port}"]

The synchronous mode generates prompts_per_step x samples_per_prompt and waits for all of them;
C3PO++ generates under a token budget equal to the synchronous mean tokens per step. Between
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

from rlrecipe.c3po import PromptStream, RolloutPool
from rlrecipe.recipe import RLSection
from rlrecipe.rollout.base import RolloutEngine
from rlrecipe.trajectory import SamplingParams

QUESTIONS = [  # used when no prompt file is given: short math questions with long-tail answers
    "What is 17 * 23?", "How many positive divisors does 360 have?", "Solve for x: 3x + 7 = 25.",
    "What is the sum of the first 50 odd numbers?", "How many primes are there below 100?",
    "What is the remainder when 2^100 is divided by 7?", "In how many ways can 8 rooks be placed on a chessboard "
    "so that none attack each other?", "What is the smallest positive integer n such that n! ends in 10 zeros?",
]


def compare(engine: RolloutEngine, rows: list[dict], tokenizer, template: str, params: SamplingParams, *,
            steps: int, prompts_per_step: int, samples_per_prompt: int, pool_capacity: int, max_staleness: int = 2,
            between_steps: Callable[[int], None] | None = None) -> dict:
    """Rollout time per step and per trained token, synchronous vs C3PO++ (steady state)."""
    def passes() -> int:
        return getattr(engine, "forward_passes", 0)

    def run(cfg: RLSection, n_steps: int, skip_first: bool) -> tuple[float, int, int]:
        pool = RolloutPool(cfg, PromptStream(rows, tokenizer, template, seed=0))
        seconds = tokens = forward = 0
        for s in range(n_steps):
            t0, p0 = time.perf_counter(), passes()
            batch, _ = pool.collect(engine, params, seed=s)
            if s > 0 or not skip_first:  # C3PO++'s first step fills an empty pool; steady state after it
                seconds += time.perf_counter() - t0
                tokens += sum(len(t.response_ids) for t in batch)
                forward += passes() - p0
            if between_steps is not None:
                between_steps(s)
        return seconds, tokens, forward

    sync_cfg = RLSection(prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                         c3po={"enabled": False})
    sync_s, sync_tok, sync_fw = run(sync_cfg, steps, skip_first=False)
    budget = max(1, sync_tok // steps)
    c3_cfg = RLSection(prompts_per_step=prompts_per_step, samples_per_prompt=samples_per_prompt,
                       c3po={"enabled": True, "token_budget": budget, "pool_capacity": pool_capacity,
                             "max_staleness": max_staleness})
    c3_s, c3_tok, c3_fw = run(c3_cfg, steps + 1, skip_first=True)
    out = {"sync_rollout_s_per_step": sync_s / steps, "c3po_rollout_s_per_step": c3_s / steps,
           "tokens_per_step_sync": budget, "tokens_per_step_c3po": c3_tok / steps,
           "rollout_speedup_per_trained_token": (c3_tok / c3_s) / (sync_tok / sync_s)}
    if sync_fw and c3_fw:
        # forward passes per trained token: what a rollout costs where decoding is memory-bound
        out.update({"sync_forward_passes_per_step": sync_fw / steps, "c3po_forward_passes_per_step": c3_fw / steps,
                    "forward_pass_ratio_per_trained_token": (sync_fw / sync_tok) / (c3_fw / c3_tok)})
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
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default="bench/c3po_server.json")
    args = ap.parse_args(argv)

    from rlrecipe.data.io import load_rows
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.recipe import SGLangServer
    from rlrecipe.rollout.sglang import SGLangEngine

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
                         samples_per_prompt=args.samples_per_prompt, pool_capacity=capacity, between_steps=reload)
    finally:
        engine.close()
    result.update(model=args.model, server="sglang" if not args.launch_cmd else args.launch_cmd.split()[0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
