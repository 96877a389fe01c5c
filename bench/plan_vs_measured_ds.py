"""`rlrecipe plan`'s per-rank training peak under DeepSpeed ZeRO against a measured step, on CPU.

  python -m bench.plan_vs_measured_ds             # a table
  python -m bench.plan_vs_measured_ds --json out.json
  python -m bench.plan_vs_measured_ds --device cuda   # on the GPUs here (make gpu-checks)

As bench/plan_vs_measured.py, with the DeepSpeed engine in two ranks (torchrun, gloo): each rank
first builds and steps a toy engine of the same ZeRO stage and drops it, so the libraries' code
and state are loaded, then records its resident memory (the baseline), builds the engine for the
configuration (float32, AdamW, DeepSpeed's default buckets), runs one step, resets its high-water
mark and runs a second; measured = that step's peak RSS above the baseline, per rank, with malloc's
mmap threshold fixed (see plan_vs_measured). Each rank trains two micro-batches of its own.
Predicted: plan.train_budget for the same recipe on CPU, per rank, without the reserve.

With --device cuda: one rank per visible GPU over nccl, bfloat16, R1-Distill-Qwen-7B's layer shapes
and vocabulary with four layers (2.0B parameters) at 16,384 tokens a micro-batch, and measured =
torch.cuda.max_memory_allocated over the second step above what is allocated before the engine
is built; predicted: the plan on CUDA (where the reduce bucket is allocated whole).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.plan_vs_measured import (
    FIXED_MMAP_THRESHOLD,
    MIB,
    MICROBATCHES,
    TOY,
    _model_dir,
    _reset_peak,
    _status_kib,
    print_rows,
)

RANKS = 2
# hidden, intermediate, layers, heads, kv heads, vocab, micro-batch tokens, checkpointing, ZeRO stage
CONFIGS = [
    (512, 1408, 4, 8, 2, 32768, 2048, True, 2),
    (512, 1408, 4, 8, 2, 32768, 2048, True, 3),
    (256, 704, 8, 4, 2, 65536, 1024, False, 2),
    (256, 704, 8, 4, 2, 65536, 1024, False, 3),
    (256, 704, 4, 4, 2, 32768, 1024, True, 2),
]


# R1-Distill-Qwen-7B's layers and vocabulary, four layers: what one H100 holds under ZeRO-2 or -3 alone
GPU_CONFIGS = [
    (3584, 18944, 4, 28, 4, 152064, 16384, True, 3),
    (3584, 18944, 4, 28, 4, 152064, 16384, True, 2),
]
DTYPE = {"cpu": "float32", "cuda": "bfloat16"}


def recipe_of(cfg, ranks: int = RANKS, dtype: str = "float32"):
    from rlrecipe.recipe.schema import recipe_from_dict

    *_, tokens, ckpt, stage = cfg
    return recipe_from_dict({"run": {"name": "bench"},
                             "model": {"tiny": {}, "gradient_checkpointing": ckpt, "dtype": dtype},
                             "trainer": {"engine": "deepspeed", "zero_stage": stage, "nproc": ranks,
                                         "max_tokens_per_microbatch": tokens}})


def predicted(cfg, device: str = "cpu", ranks: int = RANKS) -> dict[str, float]:
    from rlrecipe.checks.model_dims import ModelDims
    from rlrecipe.checks.plan import train_budget

    h, inter, layers, heads, kv, vocab, *_ = cfg
    dims = ModelDims(vocab=vocab, hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, tied=False)
    parts = dict(train_budget(recipe_of(cfg, ranks, DTYPE[device]), dims, device=device).parts)
    parts.pop("reserve")
    return parts


def _engine_and_batch(model_dir: Path, cfg, ranks: int, dtype: str):
    import torch

    from rlrecipe.train.base import TrainSample
    from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine

    *_, vocab, tokens, ckpt, _stage = cfg
    g = torch.Generator().manual_seed(0)
    n = tokens // 4  # 4 documents a micro-batch on each rank, all but the first token a response
    batch = [TrainSample(torch.randint(0, vocab, (n,), generator=g).tolist(), 1)
             for _ in range(4 * MICROBATCHES * ranks)]
    engine = DeepSpeedTrainEngine(model_dir, recipe_of(cfg, ranks, dtype).trainer, total_steps=2, dtype=dtype,
                                  gradient_checkpointing=ckpt)
    return engine, batch


def child(cfg, model_dir: Path, toy_dir: Path, out: Path, device: str) -> None:
    """One rank, under torchrun."""
    import gc

    import torch

    from rlrecipe.stages.sft import sft_step
    from rlrecipe.train.launch import init_distributed

    init_distributed()
    rank, ranks, dtype = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), DTYPE[device]
    cuda = device == "cuda"
    # DeepSpeed's and the model's code, loaded by a toy engine of the same stage and then dropped:
    # libraries are host memory the plan (a GPU budget) does not count (about 170 MiB at ZeRO-3)
    toy, toy_batch = _engine_and_batch(toy_dir, (*TOY, True, *cfg[8:]), ranks, dtype)
    sft_step(toy, toy_batch)
    toy.engine.destroy()
    del toy, toy_batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if cuda else _status_kib("VmRSS") * 1024
    engine, batch = _engine_and_batch(model_dir, cfg, ranks, dtype)
    sft_step(engine, batch)  # the first step makes AdamW's state
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        reset = True
    else:
        reset = _reset_peak()
    sft_step(engine, batch)
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    (out / f"rank{rank}.json").write_text(json.dumps({"baseline_mib": base / MIB, "measured_mib": (peak - base) / MIB,
                                                      "peak_reset": reset}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _measure(cfg, device: str = "cpu", ranks: int = RANKS) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_dir(cfg[:8], Path(tmp) / "model", dtype=DTYPE[device])
        toy = _model_dir((*TOY, True), Path(tmp) / "toy")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={ranks}",
               "-m", "bench.plan_vs_measured_ds", "--device", device,
               "--child", json.dumps(cfg), str(model), str(toy), tmp]
        env = {**os.environ, **FIXED_MMAP_THRESHOLD, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"config {cfg}: {res.stdout[-3000:]} {res.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def run(configs=CONFIGS, device: str = "cpu", ranks: int = RANKS) -> list[dict]:
    out = []
    for cfg in configs:
        by_rank = _measure(cfg, device, ranks)
        parts = predicted(cfg, device, ranks)
        pred = sum(parts.values()) / MIB
        measured = max(r["measured_mib"] for r in by_rank)
        h, inter, layers, heads, kv, vocab, tokens, ckpt, stage = cfg
        out.append({"device": device, "ranks": ranks, "dtype": DTYPE[device], "hidden": h, "layers": layers,
                    "vocab": vocab, "tokens": tokens, "checkpointing": ckpt, "zero_stage": stage,
                    "predicted_mib": pred, "predicted_parts_mib": {k: v / MIB for k, v in parts.items()},
                    "measured_mib_by_rank": [r["measured_mib"] for r in by_rank], "measured_mib": measured,
                    "predicted_over_measured": pred / measured})
    return out


def table(rows: list[dict]):
    from rich.table import Table

    first = rows[0] if rows else {"device": "cpu", "ranks": RANKS, "dtype": DTYPE["cpu"]}
    peak = "peak allocated" if first["device"] == "cuda" else "peak RSS"
    t = Table(title=f"rlrecipe plan vs a measured DeepSpeed step ({first['device']}, {first['dtype']}, "
                    f"{first['ranks']} ranks, {MICROBATCHES} micro-batches each; {peak} above baseline, the larger rank)")
    for col in ("ZeRO", "hidden", "layers", "vocab", "tokens", "ckpt", "predicted MiB", "measured MiB",
                "predicted / measured"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["zero_stage"]), str(r["hidden"]), str(r["layers"]), str(r["vocab"]), str(r["tokens"]),
                  "yes" if r["checkpointing"] else "no", f"{r['predicted_mib']:.0f}", f"{r['measured_mib']:.0f}",
                  f"{r['predicted_over_measured']:.2f}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=4, metavar=("CONFIG", "MODEL", "TOY", "DIR"))
    ap.add_argument("--device", choices=sorted(DTYPE), default="cpu")
    ap.add_argument("--ranks", type=int, help="ranks (default: 2 on CPU, every visible GPU on CUDA)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        from rlrecipe.train.launch import end_process

        child(tuple(json.loads(args.child[0])), *(Path(a) for a in args.child[1:]), args.device)
        end_process(0)  # a rank can abort in the interpreter's teardown after its result is written
    elif args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU visible")
        ranks = args.ranks or torch.cuda.device_count()
        print_rows(run(GPU_CONFIGS, "cuda", ranks), table, args.json)
    else:
        print_rows(run(ranks=args.ranks or RANKS), table, args.json)


if __name__ == "__main__":
    main()
