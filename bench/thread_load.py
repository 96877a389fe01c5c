"""The demo's SFT step quiet and under a competing load, for OpenMP wait policies (`make bench`).

Each (policy, threads, load) runs in its own process, because the OpenMP runtime reads how its
threads wait once, when torch loads. `default` is the runtime's own (torch imported before the
package, as a process that never imports rlrecipe first would); `shipped` imports the package
first with no wait setting in the environment, so it measures whatever rlrecipe/core/threads.py
chooses; the others set the environment shown in CANDIDATES. The load is one busy Python loop
per core: `loaded` starts it before the process (it is there when the package chooses), `late`
after the process has set up and taken two steps (it arrives once the choice is made). The
reference for every ratio is `default` on a quiet machine with the same thread count.

    python -m bench.thread_load            # what `make bench` records: default and shipped
    python -m bench.thread_load --study [--threads 2,1,4] [--policies ...] [--loads ...] [--out F.json]
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

DATA = Path("data/tiny-arith/sft.jsonl")
SFT_RECIPE = "recipes/tiny_sft.yaml"
WAIT_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
# name -> the environment it sets (None: nothing; the package chooses, imported before torch)
CANDIDATES: dict[str, dict | None] = {
    "default": {},
    "shipped": None,
    "spin_1k": {"GOMP_SPINCOUNT": "1000"},
    "spin_10k": {"GOMP_SPINCOUNT": "10000"},
    "spin_30k": {"GOMP_SPINCOUNT": "30000"},
    "spin_100k": {"GOMP_SPINCOUNT": "100000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
LOADS = ("quiet", "loaded", "late")


def busy(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        sum(range(10_000))


def sft_step_times(seconds: float) -> list[float]:
    """Steps of the demo's SFT recipe (its model shape, batch and micro-batch budget) for `seconds`,
    after two untimed steps and a line from the parent on stdin (`late` starts its load then)."""
    import torch

    from rlrecipe.algo.columns import TokenColumns
    from rlrecipe.data.io import load_rows
    from rlrecipe.modeling import create_tiny, load_tokenizer
    from rlrecipe.recipe.schema import load_recipe
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.recipe.training import TinyModel
    from rlrecipe.stages.sft import batch_for_step, build_sft_samples, sft_loss
    from rlrecipe.train.torch_engine import TorchTrainEngine

    recipe = load_recipe(SFT_RECIPE).recipe
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny(TinyModel(**recipe.model.tiny.model_dump()), tmp, seed=1)
        tok = load_tokenizer(model_dir)
        samples, _ = build_sft_samples(load_rows(str(DATA), "sft"), tok, "plain", recipe.sft.max_length)
        engine = TorchTrainEngine(model_dir, TrainerSection(**recipe.trainer.model_dump()), total_steps=10_000)

        def step(i: int) -> float:
            batch = batch_for_step(samples, i, recipe.sft.batch_size, recipe.run.seed)
            total = sum(s.num_response for s in batch)
            for s in batch:
                s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / total))
            t0 = time.perf_counter()
            engine.train_step(batch, sft_loss)
            return time.perf_counter() - t0

        step(0), step(1)  # allocations, once
        print("ready", flush=True)
        sys.stdin.readline()
        times, i = [], 2
        end = time.time() + seconds
        while time.time() < end or len(times) < 3:
            times.append(step(i))
            i += 1
    return times


def measure(policy: str, load: str, seconds: float, threads: int | None = None) -> dict:
    """One process's step times for one policy, thread count (None: torch's default) and load."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_ENV}
    env.update(CANDIDATES[policy] or {})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cores = os.cpu_count() or 1

    def start_load() -> list[subprocess.Popen]:
        return [subprocess.Popen([sys.executable, "-c", f"from bench.thread_load import busy; busy({seconds + 60})"])
                for _ in range(cores)]

    # torch first, so that the package leaves the runtime alone, except where it is to choose
    first = "rlrecipe" if CANDIDATES[policy] is None else "torch"
    child = (f"import {first}, json, sys; from bench.thread_load import sft_step_times; "
             f"t = sft_step_times({seconds}); import rlrecipe.core.threads as th; "
             "print(json.dumps({'times': t, 'record': th.thread_record()}))")
    load_procs = start_load() if load == "loaded" else []
    if load_procs:
        time.sleep(0.5)  # running, as a busy machine's load is, before the process starts
    proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"{policy} {load}: the measuring process failed")
        if load == "late":
            load_procs = start_load()
            time.sleep(0.5)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=seconds * 20 + 120)
    finally:
        proc.kill()
        for p in load_procs:
            p.kill()
            p.wait()
    if proc.returncode:
        raise RuntimeError(f"{policy} {load}: the measuring process exited with {proc.returncode}")
    got = json.loads(out.splitlines()[-1])
    times, rec = got["times"], got["record"]
    return {"median_s": median(times), "max_s": max(times), "steps": len(times),
            "torch_threads": rec["torch_threads"], "wait_policy": rec["wait_policy"],
            "wait_choice": rec.get("wait_choice")}


def thread_load_bench(seconds: float = 8.0) -> dict:
    """What `make bench` records: the runtime default and the shipped policy, quiet and under one
    busy loop per core, and the shipped policy's two ratios against the default quiet."""
    runs = {f"{p}_{load}": measure(p, load, seconds) for load in ("quiet", "loaded") for p in ("default", "shipped")}
    med = {k: v["median_s"] for k, v in runs.items()}
    quiet = med["default_quiet"]
    return {"steps": runs, "threads": runs["shipped_quiet"]["torch_threads"],
            "shipped_wait_quiet": str(runs["shipped_quiet"]["wait_choice"]),
            "shipped_wait_loaded": str(runs["shipped_loaded"]["wait_choice"]),
            **{f"{k}_median_s": v for k, v in med.items()},
            "shipped_quiet_over_default_quiet": med["shipped_quiet"] / quiet,
            "shipped_loaded_over_default_quiet": med["shipped_loaded"] / quiet,
            "default_loaded_over_default_quiet": med["default_loaded"] / quiet}


def study(seconds: float = 6.0, threads: tuple[int, ...] = (2, 1, 4), policies: tuple[str, ...] = tuple(CANDIDATES),
          loads: tuple[str, ...] = LOADS, out: Path | None = None) -> dict:
    """Every policy at every thread count and load, one process each; ratios against `default`
    quiet at the same thread count. Written to `out` as it goes (a long run keeps what it measured)."""
    results: dict = {}
    for n in threads:
        for load in loads:
            for p in policies:
                key = f"{n}t_{p}_{load}"
                results[key] = measure(p, load, seconds, n)
                print(f"{key}: {results[key]['median_s']:.3f} s ({results[key]['steps']} steps, "
                      f"{results[key]['wait_policy']}; {results[key]['wait_choice']})", file=sys.stderr, flush=True)
                if out:
                    out.write_text(json.dumps(results, indent=2))
    return results


def table(results: dict) -> str:
    """A markdown table of a study: median seconds a step, and the ratio to `default` quiet."""
    rows = ["| threads | policy | " + " | ".join(LOADS) + " |", "|---|---|" + "---|" * len(LOADS)]
    threads = dict.fromkeys(k.split("_", 1)[0] for k in results)
    for n in threads:
        ref = results.get(f"{n}_default_quiet", {}).get("median_s")
        for p in CANDIDATES:
            got = [results.get(f"{n}_{p}_{load}") for load in LOADS]
            if not any(got):
                continue
            cells = ["" if r is None else f"{r['median_s']:.3f} s" + (f" ({r['median_s'] / ref:.2f}×)" if ref else "")
                     for r in got]
            rows.append(f"| {n[:-1]} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", action="store_true", help="every candidate, thread count and load; a table")
    ap.add_argument("--threads", default="2,1,4", help="--study: intra-op thread counts")
    ap.add_argument("--policies", default=",".join(CANDIDATES), help="--study: candidates, from CANDIDATES")
    ap.add_argument("--loads", default=",".join(LOADS), help="--study: quiet, loaded, late")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds a process (6 in a study, 8 else)")
    ap.add_argument("--out", type=Path, default=None, help="--study: write the results here as they come")
    args = ap.parse_args()
    if not args.study:
        print(json.dumps(thread_load_bench(args.seconds or 8.0), indent=2))
        return
    res = study(args.seconds or 6.0, tuple(int(n) for n in args.threads.split(",")), tuple(args.policies.split(",")),
                tuple(args.loads.split(",")), args.out)
    print(table(res))


if __name__ == "__main__":
    main()
