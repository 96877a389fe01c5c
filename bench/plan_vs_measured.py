"""`rlrecipe plan`'s training peak against a real training step's peak memory, on CPU.

  python -m bench.plan_vs_measured            # all configurations, a table
  python -m bench.plan_vs_measured --json out.json

For each configuration (hidden size, layers, vocabulary up to 152,064, micro-batch tokens,
gradient checkpointing) a fresh subprocess imports everything, runs one warm-up training step of a
toy model through the same code (so the code pages and allocator arenas a step touches are in its
baseline), records its resident memory (the baseline), loads a random model of the configuration
with the torch engine (float32, AdamW), runs one step (AdamW's state is made), resets the kernel's
high-water mark (/proc/self/clear_refs) and runs a second step: measured = that step's peak RSS
(VmHWM) minus the baseline.

The step is what the plan describes: two packed micro-batches of 4 documents each (a real step
accumulates over many, so the later ones run beside whole gradients), every token but each
document's first a response token (the plan's worst case).

Each configuration is measured twice. With glibc's malloc as it comes, freed blocks below its
moving mmap threshold stay in the process's heap and count in RSS after the tensor is gone; the
plan counts tensors, which on a GPU the caching allocator's reserve covers. So the compared figure
is measured with the threshold fixed (MALLOC_MMAP_THRESHOLD_), where every tensor over 128 KiB is
its own mapping, returned when freed; the default allocator's figure is printed beside it.

Predicted: plan.train_budget's parts for the same configuration on CPU, without the GPU reserve.
Nothing is fitted here: the printed ratio is whatever the plan's formulas give.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
MICROBATCHES = 2
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
# The toy that warms a step's code before the baseline: hidden, intermediate, layers, heads, kv heads,
# vocab, micro-batch tokens (checkpointing as the configuration measured)
TOY = (32, 64, 1, 2, 2, 512, 256)
# hidden, intermediate, layers, heads, kv heads, vocab, micro-batch tokens, gradient checkpointing
CONFIGS = [
    (64, 128, 2, 4, 2, 4096, 1024, False),
    (256, 704, 4, 4, 2, 32768, 2048, False),
    (128, 352, 12, 4, 2, 8192, 4096, False),
    (384, 1024, 8, 6, 2, 65536, 4096, True),
    (512, 1408, 4, 8, 2, 152064, 2048, True),
    (768, 2048, 2, 12, 2, 152064, 1024, False),
    (256, 2048, 4, 4, 2, 4096, 4096, True),  # a wide MLP, a small vocabulary: a layer's backward is the peak
]


def dims_of(cfg) -> tuple:
    from rlrecipe.checks.model_dims import ModelDims

    h, inter, layers, heads, kv, vocab, _, _ = cfg
    return ModelDims(vocab=vocab, hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, tied=False)


def predicted(cfg) -> dict[str, float]:
    """plan.train_budget's parts (bytes) for this configuration, on CPU, without the GPU reserve."""
    from rlrecipe.checks.plan import train_budget
    from rlrecipe.recipe.schema import recipe_from_dict

    *_, tokens, ckpt = cfg
    recipe = recipe_from_dict({"run": {"name": "bench"}, "model": {"tiny": {}, "gradient_checkpointing": ckpt},
                               "trainer": {"engine": "torch", "max_tokens_per_microbatch": tokens}})
    parts = dict(train_budget(recipe, dims_of(cfg), device="cpu").parts)
    parts.pop("reserve")
    return parts


# -- the child: one configuration ----------------------------------------------------------------
def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _model_dir(cfg, out: Path, vocab: int | None = None, dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    h, inter, layers, heads, kv, v, _, _ = cfg
    qc = Qwen2Config(vocab_size=vocab or v, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                     tie_word_embeddings=False, use_sliding_window=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qc, dtype=getattr(torch, dtype)).save_pretrained(out)
    return out


def _step(model_dir: Path, cfg, steps: int) -> None:
    import torch

    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.stages.sft import sft_step
    from rlrecipe.train.base import TrainSample
    from rlrecipe.train.torch_engine import TorchTrainEngine

    *_, vocab, tokens, ckpt = cfg
    engine = TorchTrainEngine(model_dir, TrainerSection(max_tokens_per_microbatch=tokens), total_steps=steps,
                              gradient_checkpointing=ckpt)
    g = torch.Generator().manual_seed(0)
    n = tokens // 4  # 4 documents packed into each micro-batch, all but the first token a response
    batch = [TrainSample(torch.randint(0, vocab, (n,), generator=g).tolist(), 1) for _ in range(4 * MICROBATCHES)]
    for _ in range(steps - 1):
        sft_step(engine, batch)
    return engine, batch


def warmed_baseline(cfg, work: Path) -> tuple[Path, int]:
    """The configuration's model written, after a step of a toy with the same checkpointing has
    loaded the step's code and warmed the allocator; the resident memory then (KiB), the baseline."""
    import gc

    toy = TOY + (cfg[-1],)
    _step(_model_dir(toy, work / "toy"), toy, 2)
    gc.collect()
    model = _model_dir(cfg, work / "model")
    gc.collect()
    return model, _status_kib("VmRSS")


def child(cfg, work: Path) -> dict:
    from rlrecipe.stages.sft import sft_step

    model, base = warmed_baseline(cfg, work)
    engine, batch = _step(model, cfg, 2)  # the first step makes AdamW's state
    reset = _reset_peak()
    sft_step(engine, batch)
    peak = _status_kib("VmHWM")
    return {"baseline_mib": base / 1024, "peak_mib": peak / 1024, "measured_mib": (peak - base) / 1024,
            "peak_reset": reset}


# -- the parent ----------------------------------------------------------------------------------
def _measure(cfg, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-m", "bench.plan_vs_measured", "--child", json.dumps(cfg), tmp],
                             capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    if res.returncode != 0:
        raise RuntimeError(f"config {cfg}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(configs=CONFIGS) -> list[dict]:
    out = []
    for cfg in configs:
        got = _measure(cfg, FIXED_MMAP_THRESHOLD)
        default = _measure(cfg, {})
        parts = predicted(cfg)
        pred = sum(parts.values()) / MIB
        h, inter, layers, heads, kv, vocab, tokens, ckpt = cfg
        out.append({"hidden": h, "layers": layers, "vocab": vocab, "tokens": tokens, "checkpointing": ckpt,
                    "params_m": dims_of(cfg).params() / 1e6, "predicted_mib": pred,
                    "predicted_parts_mib": {k: v / MIB for k, v in parts.items()}, **got,
                    "predicted_over_measured": pred / got["measured_mib"],
                    "default_malloc_measured_mib": default["measured_mib"],
                    "predicted_over_default_malloc": pred / default["measured_mib"]})
    return out


def table(rows: list[dict]):
    from rich.table import Table

    t = Table(title=f"rlrecipe plan vs a measured training step (CPU, float32, torch engine, {MICROBATCHES} "
                    "micro-batches; peak RSS above baseline, malloc's mmap threshold fixed; glibc's default beside it)")
    for col in ("hidden", "layers", "vocab", "tokens", "ckpt", "params (M)", "predicted MiB", "measured MiB",
                "predicted / measured", "default malloc MiB", "predicted / it"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["hidden"]), str(r["layers"]), str(r["vocab"]), str(r["tokens"]), "yes" if r["checkpointing"] else "no",
                  f"{r['params_m']:.1f}", f"{r['predicted_mib']:.0f}", f"{r['measured_mib']:.0f}",
                  f"{r['predicted_over_measured']:.2f}", f"{r['default_malloc_measured_mib']:.0f}",
                  f"{r['predicted_over_default_malloc']:.2f}")
    return t


def print_rows(rows: list[dict], make_table, json_path: str | None) -> None:
    """The table on the console, and the rows as JSON where asked."""
    from rich.console import Console

    Console().print(make_table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "DIR"))
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(tuple(json.loads(args.child[0])), Path(args.child[1]))))
    else:
        print_rows(run(), table, args.json)


if __name__ == "__main__":
    main()
