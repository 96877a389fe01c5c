"""The demo's SFT step under a competing load, for three OpenMP wait settings (`make bench`).

Each (setting, load) pair runs in its own process, because the OpenMP runtime reads how its threads
wait once, when torch loads: `spin` is the runtime's default (torch imported before the package, as
a process that never imports rlrecipe first would), `passive` sleeps at once, `short_spin` is what
the package sets (rlrecipe/core/threads.py). The load is one busy Python loop per core, started before
and stopped after the measured steps. The reference for every ratio is `spin` on a quiet machine.

    python -m bench.thread_load            # prints a table and the ratios as JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.data.io import load_rows
from rlrecipe.modeling import create_tiny, load_tokenizer
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.recipe.training import TinyModel
from rlrecipe.stages.sft import batch_for_step, build_sft_samples, sft_loss
from rlrecipe.train.torch_engine import TorchTrainEngine

SFT_RECIPE = "recipes/tiny_sft.yaml"
DATA = Path("data/tiny-arith/sft.jsonl")
# the runtime's default (long spins), threads that sleep at once, and the package's short spin
POLICIES = {"spin": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "short_spin": {"GOMP_SPINCOUNT": "1000"}}


def busy(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        sum(range(10_000))


def sft_step_times(seconds: float) -> list[float]:
    """Steps of the demo's SFT recipe (its model shape, batch and micro-batch budget) for `seconds`."""
    recipe = load_recipe(SFT_RECIPE).recipe
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny(TinyModel(**recipe.model.tiny.model_dump()), tmp, seed=1)
        tok = load_tokenizer(model_dir)
        samples, _ = build_sft_samples(load_rows(str(DATA), "sft"), tok, "plain", recipe.sft.max_length)
        engine = TorchTrainEngine(model_dir, TrainerSection(**recipe.trainer.model_dump()), total_steps=10_000)
        step, times = 0, []
        end = time.time() + seconds
        while time.time() < end or len(times) < 3:
            batch = batch_for_step(samples, step, recipe.sft.batch_size, recipe.run.seed)
            total = sum(s.num_response for s in batch)
            for s in batch:
                s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / total))
            t0 = time.perf_counter()
            engine.train_step(batch, sft_loss)
            times.append(time.perf_counter() - t0)
            step += 1
    return times[1:]  # the first step pays for allocations once


def measure(policy: str, loaded: bool, seconds: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy])
    cores = os.cpu_count() or 1
    load = [subprocess.Popen([sys.executable, "-c", f"from bench.thread_load import busy; busy({seconds + 30})"])
            for _ in range(cores if loaded else 0)]
    # torch first, so that in the `spin` child the package leaves the runtime's default alone
    child = f"import torch, runpy, sys; sys.argv = ['', '--child', '{seconds}']; runpy.run_module('bench.thread_load', run_name='__main__')"
    try:
        out = subprocess.run([sys.executable, "-c", child], env=env,
                             capture_output=True, text=True, check=True, timeout=seconds * 20 + 120).stdout
    finally:
        for p in load:
            p.kill()
            p.wait()
    times = json.loads(out.splitlines()[-1])
    return {"median_s": median(times), "max_s": max(times), "steps": len(times)}


def thread_load_bench(seconds: float = 8.0) -> dict:
    """Median SFT step seconds for each policy, quiet and under one busy loop per core."""
    rows = {f"{p}_{'loaded' if loaded else 'quiet'}": measure(p, loaded, seconds)
            for loaded in (False, True) for p in POLICIES}
    med = {k: v["median_s"] for k, v in rows.items()}
    quiet = med["spin_quiet"]
    return {"steps": rows, "threads": torch.get_num_threads(), **{f"{k}_median_s": v for k, v in med.items()},
            **{f"{k}_over_spin_quiet": v / quiet for k, v in med.items() if k != "spin_quiet"}}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(sft_step_times(float(sys.argv[2]))))
    else:
        print(json.dumps(thread_load_bench(), indent=2))
