"""`make bench`: ratios measured side by side in one run; writes bench/results.json, prints a table.

Never part of `make test`; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import median

import torch
from rich.table import Table

from bench.async_overlap import overlap_bench
from bench.grading import grading_bench
from bench.inputs import DATA, MODEL, console, ensure_inputs
from bench.load import LoadMeter, warning
from bench.pairing import paired_rounds, ratio_summary, round_ratios
from bench.report import write as write_report
from bench.run_c3po import (
    bench_c3po,
    bench_c3po_end_to_end,
    bench_prefill,
    bench_projection,
    bench_recipe_projection,
    c3po_table,
)
from bench.thread_load import thread_load_bench
from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.packing import allocate_microbatches
from rlrecipe.data.io import load_rows
from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.run.env import cpu_record
from rlrecipe.stages.sft import build_sft_samples, sft_loss
from rlrecipe.train.torch_engine import TorchTrainEngine
from rlrecipe.trajectory.record import SamplingParams, Trajectory

OUT = Path("bench/results.json")


def bench_demo_steps(end_to_end: dict, steps: int = 5) -> dict:
    """Where one step of the demo's two stages spends its time: an SFT step of tiny_sft.yaml (batch
    assembly, then train_step: forward, backward, optimizer) and a synchronous RL step of tiny_rl.yaml
    (rollout, grading, training: from the end-to-end runs above)."""
    from rlrecipe.recipe.schema import load_recipe
    from rlrecipe.stages.sft import batch_for_step, sft_step

    recipe = load_recipe("recipes/tiny_sft.yaml").recipe
    tok = load_tokenizer(MODEL)
    samples, _ = build_sft_samples(load_rows(str(DATA / "sft.jsonl"), "sft"), tok, recipe.data.prompt_template,
                                   recipe.sft.max_length)
    engine = TorchTrainEngine(MODEL, recipe.trainer, total_steps=steps + 1)
    batch_s = train_s = 0.0
    for step in range(steps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        batch = batch_for_step(samples, step, recipe.sft.batch_size, recipe.run.seed)
        t1 = time.perf_counter()
        sft_step(engine, batch)
        if step:
            batch_s, train_s = batch_s + t1 - t0, train_s + time.perf_counter() - t1
    rl = end_to_end["steps"]["sync"]
    out = {"sft_batch_s": batch_s / steps, "sft_train_step_s": train_s / steps,
           "sft_tokens_per_step": sum(len(s.input_ids) for s in batch)}
    out.update({f"rl_{k}_per_step": sum(r[k] for r in rl) / len(rl) for k in ("rollout_s", "grade_s", "train_s")})
    return out


def _sft_samples(n: int = 256):
    tok = load_tokenizer(MODEL)
    samples, _ = build_sft_samples(load_rows(str(DATA / "sft.jsonl"), "sft")[:n], tok, "plain", 512)
    total = sum(s.num_response for s in samples)
    for s in samples:
        s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / total))
    return samples


def causal_cells(n: int) -> int:
    """Query-key pairs a causal attention over n tokens computes."""
    return n * (n + 1) // 2


def bench_packing(budget: int = 2048, rounds: int = 5) -> dict:
    samples = _sft_samples()
    engine = TorchTrainEngine(MODEL, TrainerSection(max_tokens_per_microbatch=budget), total_steps=100)
    lengths = [len(s.input_ids) for s in samples]
    bins = allocate_microbatches(lengths, budget)

    # padded baseline: same weights, same sequences, same number of sequences per micro-batch,
    # right-padded, under transformers' sdpa (the engine's packed attention takes one row only)
    model = load_model(MODEL, "float32", "sdpa")
    per_mb = max(1, len(samples) // len(bins))
    padded_mbs = [samples[i:i + per_mb] for i in range(0, len(samples), per_mb)]
    widths = [max(len(s.input_ids) for s in mb) for mb in padded_mbs]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def padded_step():
        opt.zero_grad()
        for mb, width in zip(padded_mbs, widths, strict=True):
            ids = torch.zeros((len(mb), width), dtype=torch.long)
            mask = torch.zeros((len(mb), width), dtype=torch.long)
            for j, s in enumerate(mb):
                ids[j, :len(s.input_ids)] = torch.tensor(s.input_ids)
                mask[j, :len(s.input_ids)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()
        opt.step()

    steps = {"packed": lambda: engine.train_step(samples, sft_loss), "padded": padded_step}
    times = paired_rounds(steps, rounds)
    ratios = round_ratios(times, "padded", "packed")
    padded_tokens = sum(len(mb) * width for mb, width in zip(padded_mbs, widths, strict=True))
    # causal attention cells (query-key pairs) each side computes: padded rows attend their padding too
    padded_cells = sum(len(mb) * causal_cells(width) for mb, width in zip(padded_mbs, widths, strict=True))
    return {"packed_s_per_step": median(times["packed"]), "padded_s_per_step": median(times["padded"]),
            "packed_speedup": median(ratios), "packed_speedup_min": min(ratios), "packed_speedup_max": max(ratios),
            "speedup_ceiling_from_padding": padded_tokens / sum(lengths),
            "attention_cells_ratio": padded_cells / sum(causal_cells(n) for n in lengths),
            "microbatches": len(bins), "microbatch_lower_bound": -(-sum(lengths) // budget),
            "padding_fraction_padded": 1 - sum(lengths) / padded_tokens, "padding_fraction_packed": 0.0,
            **one_thread_speedup(steps, rounds=3)}


def one_thread_speedup(steps: dict, rounds: int) -> dict:
    """The same comparison with one intra-op thread. Packed micro-batches attend one short document
    at a time, and the CPU flash-attention kernels split such a call poorly between threads (they
    scaled 1.34x from one thread to two, against 1.95x for the matmuls): this shows how much of
    the gap to the padding ceiling is that, beside the multi-threaded figure, not instead of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = paired_rounds(steps, rounds)
    finally:
        torch.set_num_threads(threads)
    return {"packed_speedup_1_thread": median(round_ratios(times, "padded", "packed")),
            "packed_s_per_step_1_thread": median(times["packed"]),
            "padded_s_per_step_1_thread": median(times["padded"])}


def bench_trainer_overhead(rounds: int = 5) -> dict:
    """Our train_step vs a bare torch loop over the very same packed micro-batches."""
    samples = _sft_samples()
    engine = TorchTrainEngine(MODEL, TrainerSection(max_tokens_per_microbatch=2048), total_steps=100)
    mbs = engine.microbatches(samples)
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

    times = paired_rounds({"ours": lambda: engine.train_step(samples, sft_loss), "bare": bare}, rounds)
    return {"ours_s_per_step": median(times["ours"]), "bare_torch_s_per_step": median(times["bare"]),
            **ratio_summary("overhead_ratio", round_ratios(times, "ours", "bare"))}


def bench_grading() -> dict:
    """Answers per second by kind (fast path, short, math-verify only), the workers' CPU per answer,
    math-verify's own cost split on one core, and `rlrecipe grade` wall times."""
    return grading_bench()


def generated_tokens(new: torch.Tensor, eos: int) -> int:
    """Tokens `generate` really produced in each row of `new` (the part after the prompt): up to and
    including the first eos, all of them where there is none. Finished rows are padded out to the
    batch's longest, and the padding is not generation (the engine's count stops at eos too)."""
    is_eos = new == eos
    lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new.shape[1])
    return int(lengths.sum())


def bench_engine(n: int = 256, rounds: int = 3) -> dict:
    """Slot-refilling engine vs plain transformers generate on the same prompts, same model: tokens
    per second of each, the two taken in turn within each round (paired_rounds); the speed-up is
    the median of the rounds' ratios."""
    tok = load_tokenizer(MODEL)
    rows = load_rows(str(DATA / "rl.jsonl"), "rl")[:n]
    from rlrecipe.data.templates import prompt_token_ids

    prompts = [prompt_token_ids(tok, r["prompt"], "plain") for r in rows]
    engine = InProcessEngine(MODEL, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=128)
    model = load_model(MODEL)
    tok.padding_side = "left"

    tokens: dict[str, list[int]] = {"ours": [], "hf": []}  # each call's; HF's sampling is not seeded

    def ours() -> None:
        trajs = [Trajectory(uid=str(i), prompt_ids=p) for i, p in enumerate(prompts)]
        engine.generate(trajs, SamplingParams(max_new_tokens=160), seed=0)
        tokens["ours"].append(sum(len(t.response_ids) for t in trajs))

    def hf() -> None:
        count = 0
        for i in range(0, n, 128):
            batch = tok.pad({"input_ids": prompts[i:i + 128]}, return_tensors="pt")
            out = model.generate(**batch, max_new_tokens=160, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id)
            count += generated_tokens(out[:, batch["input_ids"].shape[1]:], tok.eos_token_id)
        tokens["hf"].append(count)

    times = paired_rounds({"ours": ours, "hf": hf}, rounds)
    rate = {k: [count / s for count, s in zip(tokens[k][1:], times[k], strict=True)] for k in times}  # [1:]: warm-up
    ratios = [a / b for a, b in zip(rate["ours"], rate["hf"], strict=True)]
    return {"ours_tokens_per_s": median(rate["ours"]), "hf_generate_tokens_per_s": median(rate["hf"]),
            "speedup": median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)}


def bench_logprob_memory() -> dict:
    """Peak memory per token of one micro-batch at V = 152,064: full logits (before) vs chunked (the
    trainer's path), measured beside the plan's estimate of the chunked log-prob term."""
    from bench.logprob_memory import SHAPES, VOCAB, run
    from rlrecipe.checks.model_dims import ModelDims
    from rlrecipe.checks.step_memory import logprob_bytes

    tokens, chunk = [2048, 4096], 1024
    res = run("tiny", tokens, "cpu", chunk)
    h, inter, layers, heads, kv = SHAPES["tiny"]
    dims = ModelDims(VOCAB, h, inter, layers, heads, kv, tied=False)
    measured = {p["tokens"]: p["peak_mib"] for p in res["points"] if p["path"] == "chunked"}
    return {"full_mib_per_token": res["full_mib_per_token"], "chunked_mib_per_token": res["chunked_mib_per_token"],
            "fp32_logits_row_mib": VOCAB * 4 / 2**20,
            "chunked_peak_mib_at_4096": measured[4096],
            "plan_logprob_mib_at_4096": logprob_bytes(dims, 4096, chunk, 4, 4) / 2**20}


def plan_rows_summary(rows: list[dict], key_of) -> dict:
    """Predicted, measured and their ratio per configuration (keyed by `key_of(row)`), and how many
    are within 10%."""
    out: dict = {"rows": rows}
    for r in rows:
        key = key_of(r)
        out[f"{key}_predicted_mib"] = r["predicted_mib"]
        out[f"{key}_measured_mib"] = r["measured_mib"]
        out[f"{key}_predicted_over_measured"] = r["predicted_over_measured"]
    out["within_10pct"] = sum(abs(r["predicted_over_measured"] - 1) <= 0.10 for r in rows)
    out["configurations"] = len(rows)
    return out


def bench_plan_vs_measured() -> dict:
    """`rlrecipe plan`'s training peak against a real step's peak RSS, for several configurations
    (bench/plan_vs_measured.py; one subprocess each); the full rows are in results.json."""
    from bench.plan_vs_measured import run

    def key(r: dict) -> str:
        return f"h{r['hidden']}_L{r['layers']}_V{r['vocab']}_T{r['tokens']}"

    rows = run()
    out = plan_rows_summary(rows, key)
    for r in rows:
        out[f"{key(r)}_predicted_over_default_malloc"] = r["predicted_over_default_malloc"]
    out["within_10pct_default_malloc"] = sum(abs(r["predicted_over_default_malloc"] - 1) <= 0.10 for r in rows)
    return out


def bench_plan_vs_measured_deepspeed() -> dict:
    """The same per rank under DeepSpeed ZeRO-2 and ZeRO-3, two ranks (bench/plan_vs_measured_ds.py)."""
    from bench.plan_vs_measured_ds import run

    return plan_rows_summary(run(), lambda r: f"zero{r['zero_stage']}_h{r['hidden']}_L{r['layers']}_V{r['vocab']}"
                                              f"_T{r['tokens']}")


def bench_async_projection() -> dict:
    """The 7B asynchronous projection's fast form, push costed (bench/projection/async_fast.py): async +
    C3PO++ (lag 2, 80 + 48) against the shipped synchronous split and the colocated layout, per trained
    token, on both length distributions, with the push's sensitivity; and whether AReaL's 2.27x is met."""
    from bench.projection.async_fast import fast_projection

    return fast_projection()


def bench_colocated_projection() -> dict:
    """The 7B colocated C3PO++ projection with every phase change costed (bench/projection/colocated.py):
    against the shipped split per trained token on both length distributions, the sensitivity to each
    phase-cost assumption, and whether 2.27x is met."""
    from bench.projection.colocated import colocated_projection

    return colocated_projection()


def bench_colocated_phases() -> dict:
    """A colocated step's hand-overs on this CPU through `rlrecipe serve`, beside the same step with
    the server keeping its memory (bench/colocated_phases.py)."""
    from bench.colocated_phases import colocated_phases_bench

    return colocated_phases_bench()


def bench_fp8_kv_projection() -> dict:
    """The 7B projection with an FP8 KV cache beside bf16 (bench/projection/fp8_kv.py): the decode bound
    with the cache full, the rollout and the step per trained token."""
    from bench.projection.fp8_kv import fp8_projection

    return fp8_projection()


def bench_weight_fingerprint() -> dict:
    """Seconds per weight push and per fingerprint check after it, against `rlrecipe serve`
    (bench/weight_fingerprint.py)."""
    from bench.weight_fingerprint import run

    return run()


# The slow ones, left to `make bench-full`: those that start processes of their own (DeepSpeed ranks, a
# server beside a trainer, one process per plan configuration), minutes each on 2 cores (a user's
# 2-core machine: plan_vs_measured 876 s, async_vs_sync_cpu 880 s, colocated_phases_cpu 406 s).
# `sft_step_under_load` starts processes too (four runs of a step, about a minute and a half) but stays
# in the fast set: it checks the wait policy every process gets. docs/performance.md: what each took.
FULL_ONLY = ("async_vs_sync_cpu", "plan_vs_measured", "plan_vs_measured_deepspeed", "colocated_phases_cpu")


def benchmarks(results: dict) -> list[tuple[str, object]]:
    return [("c3po_vs_sync", bench_c3po), ("c3po_vs_sync_end_to_end", bench_c3po_end_to_end),
            ("demo_steps", lambda: bench_demo_steps(results["c3po_vs_sync_end_to_end"])),
            ("prefill_packed_vs_padded", lambda: bench_prefill(results["c3po_vs_sync"]["token_budget"])),
            ("packed_vs_padded", bench_packing),
            ("trainer_overhead", bench_trainer_overhead), ("grading", bench_grading),
            ("sft_step_under_load", thread_load_bench), ("async_vs_sync_cpu", overlap_bench),
            ("engine_refill_vs_generate", bench_engine), ("logprob_memory", bench_logprob_memory),
            ("plan_vs_measured", bench_plan_vs_measured),
            ("plan_vs_measured_deepspeed", bench_plan_vs_measured_deepspeed),
            ("weight_fingerprint", bench_weight_fingerprint), ("colocated_phases_cpu", bench_colocated_phases),
            ("async_projection_7b", bench_async_projection),
            ("colocated_projection_7b", bench_colocated_projection), ("fp8_kv_projection_7b", bench_fp8_kv_projection)]


def timed(name: str, fn, results: dict, seconds: dict, loads: dict) -> None:
    """Run one benchmark under a LoadMeter: its result, wall seconds and load recorded, its time printed,
    and a warning when it ran on a busy machine (its result then carries busy: true)."""
    console.print(f"[bold]bench[/] {name} ...")
    with LoadMeter() as meter:
        out = fn()
    rec = meter.record
    results[name], seconds[name], loads[name] = {**out, "busy": rec["busy"]}, rec["wall_s"], rec
    console.print(f"[bold]bench[/] {name}: {rec['wall_s']:.1f} s (1-min load {rec['load1']:.1f}, run queue "
                  f"{rec['run_queue_median']:g}, others {rec['others_cpu_cores']:.2f} cores, steal "
                  f"{rec['steal_share']:.1%})", highlight=False)
    if rec["busy"]:
        console.print(f"[bold red]{warning(name, rec)}[/]", highlight=False)


def time_table(seconds: dict, loads: dict, total_s: float) -> Table:
    """How long each part took, and the load it ran under."""
    table = Table(title=f"bench: {total_s / 60:.1f} minutes in all")
    for col in ("benchmark", "seconds", "1-min load", "run queue", "others' cores", "steal", "busy"):
        table.add_column(col, justify="left" if col == "benchmark" else "right")
    for name, s in seconds.items():
        rec = loads.get(name)
        if rec is None:  # the inputs (the demo's model and data), not measured
            table.add_row(name, f"{s:.1f}", *["-"] * 5)
            continue
        table.add_row(name, f"{s:.1f}", f"{rec['load1']:.1f}", f"{rec['run_queue_median']:g}",
                      f"{rec['others_cpu_cores']:.2f}", f"{rec['steal_share']:.1%}", "BUSY" if rec["busy"] else "")
    return table


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"also {', '.join(FULL_ONLY)}")
    full = parser.parse_args().full
    t_start = time.perf_counter()
    ensure_inputs()
    results: dict = {}
    seconds: dict[str, float] = {"inputs": round(time.perf_counter() - t_start, 1)}
    loads: dict[str, dict] = {}
    for name, fn in benchmarks(results):
        if name in FULL_ONLY and not full:
            continue
        timed(name, fn, results, seconds, loads)
    results["c3po_projection"] = bench_projection(results["c3po_vs_sync"], results["c3po_vs_sync_end_to_end"])
    timed("c3po_recipe_projection", bench_recipe_projection, results, seconds, loads)
    total_s = time.perf_counter() - t_start
    # what each benchmark took, this run, and the load it ran under
    results["bench_seconds"] = {**seconds, "total": round(total_s, 1), "mode_full": float(full)}
    results["bench_load"] = loads
    results["env"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "time": time.time(),
                      "cpu": cpu_record()["model"]}
    OUT.write_text(json.dumps(results, indent=2))
    write_report(OUT)
    print_tables(results, full)
    console.print(time_table(seconds, loads, total_s))
    busy = [name for name, rec in loads.items() if rec["busy"]]
    if busy:
        console.print(f"[bold red]WARNING taken on a busy machine, not findings: {', '.join(busy)}[/]", highlight=False)
    console.print(f"written to {OUT}")


def print_tables(results: dict, full: bool) -> None:
    table = Table(title="rlrecipe bench (ratios from one run, same machine)")
    table.add_column("benchmark")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, vals in results.items():
        if name in ("env", "c3po_projection", "bench_load"):
            continue
        for k, v in vals.items():
            if isinstance(v, (dict, list)):
                continue  # traces and per-step records: in results.json
            table.add_row(name, k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(c3po_table(results))
    from bench.projection.colocated import markdown as colocated_table

    console.print(colocated_table(results["colocated_projection_7b"]), highlight=False)
    from bench.projection.fp8_kv import markdown as fp8_table

    console.print(fp8_table(results["fp8_kv_projection_7b"]), highlight=False)
    if full:
        from bench.plan_vs_measured import table as plan_table
        from bench.plan_vs_measured_ds import table as plan_ds_table

        console.print(plan_table(results["plan_vs_measured"]["rows"]))
        console.print(plan_ds_table(results["plan_vs_measured_deepspeed"]["rows"]))


if __name__ == "__main__":
    main()
