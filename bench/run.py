"""`make bench`: ratios measured side by side in one run; writes bench/results.json, prints a table.

Never part of `make test`; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.c3po_compare import compare
from bench.grading import file_times, rates
from rlrecipe.algo.packing import allocate_microbatches
from rlrecipe.data.io import load_rows
from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe import TrainerSection
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.sft import build_sft_samples, sft_loss
from rlrecipe.train.torch_engine import TorchTrainEngine
from rlrecipe.trajectory import SamplingParams, Trajectory

console = Console()
OUT = Path("bench/results.json")
DATA = Path("data/tiny-arith")
MODEL = Path("runs/tiny-sft/final")


def seconds_per_call(fn, repeats: int) -> float:
    """Mean wall time of `fn` after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def ensure_inputs() -> None:
    """The benchmarks use the demo's SFT model: its responses have the task's long-tail lengths."""
    if not (DATA / "rl.jsonl").exists():
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "data", "make", "tiny-arith", "--out", str(DATA)],
                       check=True)
    if not (MODEL / "config.json").exists():
        console.print("no runs/tiny-sft/final yet: training it with recipes/tiny_sft.yaml first")
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "sft", "recipes/tiny_sft.yaml",
                        "--set", "eval.benchmarks=[]"], check=True)


def bench_c3po(steps: int = 6) -> dict:
    """Synchronous batches vs C3PO++ with the same tokens trained per step (same weights, no update)."""
    tok = load_tokenizer(MODEL)
    engine = InProcessEngine(MODEL, tok.eos_token_id, tok.pad_token_id, dtype="bfloat16", max_batch=1024)
    return compare(engine, load_rows(str(DATA / "rl.jsonl"), "rl"), tok, "plain",
                   SamplingParams(temperature=1.0, max_new_tokens=160), steps=steps, prompts_per_step=64,
                   samples_per_prompt=8, pool_capacity=1024)


def bench_c3po_end_to_end(steps: int = 5) -> dict:
    """Whole RL steps (rollout + grading + training + weight push) with tiny_rl.yaml, C3PO++ on vs off."""
    from rlrecipe.recipe import load_recipe
    from rlrecipe.rl import run_rl

    per_token = {}
    for mode, enabled in (("sync", False), ("c3po", True)):
        loaded = load_recipe("recipes/tiny_rl.yaml", [
            f"run.name=bench-rl-{mode}", f"run.init_from={MODEL}", f"rl.steps={steps}", "eval.benchmarks=[]",
            f"rl.c3po.enabled={str(enabled).lower()}", "run.output_dir=.cache/bench-runs"])
        run_rl(loaded, overwrite=True)  # the bench's own scratch runs
        rows = [json.loads(line) for line in
                (Path(".cache/bench-runs") / f"bench-rl-{mode}" / "metrics.jsonl").read_text().splitlines()]
        rows = rows[1:]  # the first C3PO++ step fills an empty pool
        per_token[mode] = sum(r["rollout_s"] + r["train_s"] for r in rows) / sum(r["tokens_trained"] for r in rows)
    return {"sync_s_per_1k_trained_tokens": 1000 * per_token["sync"],
            "c3po_s_per_1k_trained_tokens": 1000 * per_token["c3po"],
            "end_to_end_speedup": per_token["sync"] / per_token["c3po"]}


def _sft_samples(n: int = 256):
    tok = load_tokenizer(MODEL)
    samples, _ = build_sft_samples(load_rows(str(DATA / "sft.jsonl"), "sft")[:n], tok, "plain", 512)
    total = sum(s.num_response for s in samples)
    for s in samples:
        s.fields = {"scale": torch.full((s.num_response,), 1.0 / total)}
    return samples


def bench_packing(budget: int = 2048, repeats: int = 3) -> dict:
    samples = _sft_samples()
    engine = TorchTrainEngine(MODEL, TrainerSection(max_tokens_per_microbatch=budget), total_steps=100)
    lengths = [len(s.input_ids) for s in samples]
    bins = allocate_microbatches(lengths, budget)
    packed_s = seconds_per_call(lambda: engine.train_step(samples, sft_loss), repeats)

    # padded baseline: same weights, same sequences, same number of sequences per micro-batch,
    # right-padded, under transformers' sdpa (the engine's packed attention takes one row only)
    model = load_model(MODEL, "float32", "sdpa")
    per_mb = max(1, len(samples) // len(bins))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def padded_step():
        opt.zero_grad()
        for i in range(0, len(samples), per_mb):
            mb = samples[i:i + per_mb]
            width = max(len(s.input_ids) for s in mb)
            ids = torch.zeros((len(mb), width), dtype=torch.long)
            mask = torch.zeros((len(mb), width), dtype=torch.long)
            for j, s in enumerate(mb):
                ids[j, :len(s.input_ids)] = torch.tensor(s.input_ids)
                mask[j, :len(s.input_ids)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()
        opt.step()

    padded_s = seconds_per_call(padded_step, repeats)
    padded_tokens = sum(max(len(s.input_ids) for s in samples[i:i + per_mb]) * len(samples[i:i + per_mb])
                        for i in range(0, len(samples), per_mb))
    return {"packed_s_per_step": packed_s, "padded_s_per_step": padded_s, "packed_speedup": padded_s / packed_s,
            "microbatches": len(bins), "microbatch_lower_bound": -(-sum(lengths) // budget),
            "padding_fraction_padded": 1 - sum(lengths) / padded_tokens, "padding_fraction_packed": 0.0}


def bench_trainer_overhead(repeats: int = 3) -> dict:
    """Our train_step vs a bare torch loop over the very same packed micro-batches."""
    samples = _sft_samples()
    engine = TorchTrainEngine(MODEL, TrainerSection(max_tokens_per_microbatch=2048), total_steps=100)
    mbs = engine.microbatches(samples)
    ours = seconds_per_call(lambda: engine.train_step(samples, sft_loss), repeats)
    model, opt = engine.model, torch.optim.AdamW(engine.model.parameters(), lr=1e-4)
    from rlrecipe.algo.packing import pack

    def bare():
        opt.zero_grad()
        for mb in mbs:
            ids, pos = pack([s.input_ids for s in mb])
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            (-logp.sum() / ids.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    base = seconds_per_call(bare, repeats)
    return {"ours_s_per_step": ours, "bare_torch_s_per_step": base, "overhead_ratio": ours / base}


def bench_grading() -> dict:
    """Answers per second by kind (fast path, short, math-verify only) and `rlrecipe grade` wall times."""
    return {**rates(), **file_times()}


def bench_engine(n: int = 256) -> dict:
    """Slot-refilling engine vs plain transformers generate on the same prompts, same model."""
    tok = load_tokenizer(MODEL)
    rows = load_rows(str(DATA / "rl.jsonl"), "rl")[:n]
    from rlrecipe.data.templates import prompt_token_ids

    prompts = [prompt_token_ids(tok, r["prompt"], "plain") for r in rows]
    engine = InProcessEngine(MODEL, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=128)
    model = load_model(MODEL)
    tok.padding_side = "left"

    def ours() -> int:
        trajs = [Trajectory(uid=str(i), prompt_ids=p) for i, p in enumerate(prompts)]
        engine.generate(trajs, SamplingParams(max_new_tokens=160), seed=0)
        return sum(len(t.response_ids) for t in trajs)

    def hf() -> int:
        tokens = 0
        for i in range(0, n, 128):
            batch = tok.pad({"input_ids": prompts[i:i + 128]}, return_tensors="pt")
            out = model.generate(**batch, max_new_tokens=160, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id)
            new = out[:, batch["input_ids"].shape[1]:]
            tokens += int(((new != tok.pad_token_id).cumsum(-1) > 0).sum())
        return tokens

    ours_tokens, hf_tokens = ours(), hf()  # warm-up, and the token counts
    ours_s, hf_s = seconds_per_call(ours, 3), seconds_per_call(hf, 3)
    return {"ours_tokens_per_s": ours_tokens / ours_s, "hf_generate_tokens_per_s": hf_tokens / hf_s,
            "speedup": (ours_tokens / ours_s) / (hf_tokens / hf_s)}


def bench_logprob_memory() -> dict:
    """Peak memory per token of one micro-batch at V = 152,064: full logits (before) vs chunked (the
    trainer's path), measured beside the plan's estimate of the chunked log-prob term."""
    from bench.logprob_memory import SHAPES, VOCAB, run
    from rlrecipe.plan import ModelDims, logprob_bytes

    tokens, chunk = [2048, 4096], 1024
    res = run("tiny", tokens, "cpu", chunk)
    h, inter, layers, heads, kv = SHAPES["tiny"]
    dims = ModelDims(VOCAB, h, inter, layers, heads, kv, tied=False)
    measured = {p["tokens"]: p["peak_mib"] for p in res["points"] if p["path"] == "chunked"}
    return {"full_mib_per_token": res["full_mib_per_token"], "chunked_mib_per_token": res["chunked_mib_per_token"],
            "fp32_logits_row_mib": VOCAB * 4 / 2**20,
            "chunked_peak_mib_at_4096": measured[4096],
            "plan_logprob_mib_at_4096": logprob_bytes(dims, 4096, chunk, 4) / 2**20}


def main() -> None:
    ensure_inputs()
    results = {}
    for name, fn in [("c3po_vs_sync", bench_c3po), ("c3po_vs_sync_end_to_end", bench_c3po_end_to_end),
                     ("packed_vs_padded", bench_packing),
                     ("trainer_overhead", bench_trainer_overhead), ("grading", bench_grading),
                     ("engine_refill_vs_generate", bench_engine), ("logprob_memory", bench_logprob_memory)]:
        console.print(f"[bold]bench[/] {name} ...")
        results[name] = fn()
    results["env"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "time": time.time()}
    OUT.write_text(json.dumps(results, indent=2))
    table = Table(title="rlrecipe bench (ratios from one run, same machine)")
    table.add_column("benchmark")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, vals in results.items():
        if name == "env":
            continue
        for k, v in vals.items():
            table.add_row(name, k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(f"written to {OUT}")


if __name__ == "__main__":
    main()
