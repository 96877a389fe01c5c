"""Synchronous vs asynchronous RL on this CPU, one variable at a time (`make bench-full`).

Three arms train the tiny recipe from the demo's SFT model for the same steps, every one with its
rollout on a `rlrecipe serve` server over HTTP (float32, weights pushed through disk) and every process
under the same OpenMP wait (the short spin, GOMP_SPINCOUNT=1000), so that neighbouring arms differ in
one thing:
- shared: synchronous, server and trainer each with two threads on both cores, as a colocated
  cluster runs rollout and training in turn;
- split: synchronous, the server pinned to one core and the trainer to the other, one thread each, as
  rollout and training GPUs are separate on a cluster (shared -> split: the placement only);
- async: split, with `rl.async_lag` 1 (split -> async: the lag only). A split step costs about rollout
  + train; an asynchronous one about the larger of the two.
Each arm runs `repeats` times; a run's step time is the median wall clock of its steps after the first
(`step_wall_s`); an arm reports the median over its runs and their range. The arms run in paired
rounds (one run of each per round) and each ratio is the median of the rounds' ratios, with their
range (bench/pairing.py). Async pays on this machine only if it beats the shared arm, not just the
split one.

    python -m bench.async_overlap [--repeats 3] [--steps 8]   # prints the comparison as JSON
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from bench.pairing import paired

RECIPE = Path("recipes/tiny_rl.yaml")
MODEL = Path("runs/tiny-sft/final")
WAIT = {"GOMP_SPINCOUNT": "1000"}  # every process of every arm (rlrecipe/core/threads.py's short spin)
ARMS = ("shared", "split", "async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(core: int) -> list[str]:
    cores = os.cpu_count() or 1
    return ["taskset", "-c", str(core % cores)] if cores > 1 else []


def arm_overrides(out: Path, arm: str, run: int, steps: int) -> tuple[dict, int, list[str]]:
    """(recipe overrides, threads per process, the trainer's pinning) of one run of an arm."""
    split = arm in ("split", "async")
    threads = 1 if split else min(2, os.cpu_count() or 1)
    serve = [*(_pinned(0) if split else []), sys.executable, "-m", "rlrecipe.cli.app", "serve", "{model}", "--host",
             "{host}", "--port", "{port}", "--dtype", "{dtype}"]
    over = {"run.name": f"overlap-{arm}-{run}", "run.output_dir": str(out), "run.init_from": str(MODEL.resolve()),
            "rl.steps": steps, "rl.save_every": steps, "rl.async_lag": 1 if arm == "async" else 0,
            "eval.benchmarks": [], "rollout.engine": "sglang", "rollout.dtype": "float32",
            "rollout.sglang.base_port": _free_port(), "rollout.sglang.weight_sync": "disk",
            "rollout.sglang.launch_cmd": serve}
    return over, threads, _pinned(1) if split else []


def _train(out: Path, over: dict, threads: int, prefix: list[str]) -> list[dict]:
    """`rlrecipe rl` of the tiny recipe with these overrides, `threads` intra-op threads in every process
    (the server inherits the environment), under `prefix` (a core pinning); its metrics rows."""
    sets = [x for k, v in over.items() for x in ("--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}")]
    env = {**os.environ, **WAIT, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([*prefix, sys.executable, "-m", "rlrecipe.cli.app", "rl", str(RECIPE), *sets], env=env,
                   check=True, capture_output=True, timeout=1800)
    rows = out / over["run.name"] / "metrics.jsonl"
    return [json.loads(line) for line in rows.read_text().splitlines()]


def summarise(rows: list[dict]) -> dict:
    """One run: medians over the steps after the first (which pays for start-up); the step is its wall clock."""
    rows = rows[1:] or rows
    return {"step_s": median(r["step_wall_s"] for r in rows),
            "rollout_s": median(r.get("rollout_collect_s", r["rollout_s"]) for r in rows),
            "train_s": median(r["train_s"] for r in rows), "wait_s": median(r["rollout_s"] for r in rows),
            "s_per_trained_token": sum(r["step_wall_s"] for r in rows) / sum(r["tokens_trained"] for r in rows)}


def over_runs(runs: list[dict]) -> dict:
    """An arm: the median over its runs of each figure, and the range of the step time."""
    out = {k: median(r[k] for r in runs) for k in runs[0]}
    out["step_s_min"], out["step_s_max"] = min(r["step_s"] for r in runs), max(r["step_s"] for r in runs)
    out["runs"] = len(runs)
    return out


def compare(arms: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    """The ratios, each between arms that differ in one thing (or, last, async against the shared arm):
    round by round (runs[arm][i] is round i's run; bench.pairing), the median of the rounds' ratios
    with their min and max; the split and async steps against their parts from the arms' medians."""
    p, a = arms["split"], arms["async"]
    return {**paired(runs, "placement_split_over_shared_per_step", "shared", "split", "step_s"),
            **paired(runs, "lag_async_over_split_per_step", "split", "async", "step_s"),
            **paired(runs, "lag_async_over_split_per_trained_token", "split", "async", "s_per_trained_token"),
            **paired(runs, "async_vs_shared_per_step", "shared", "async", "step_s"),
            **paired(runs, "async_vs_shared_per_trained_token", "shared", "async", "s_per_trained_token"),
            "split_step_over_rollout_plus_train": p["step_s"] / (p["rollout_s"] + p["train_s"]),
            "async_step_over_max_of_two": a["step_s"] / max(a["rollout_s"], a["train_s"])}


def overlap_bench(steps: int = 8, repeats: int = 3) -> dict:
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(repeats):  # paired rounds: a machine that drifts drifts under each arm of a round
            for arm in ARMS:
                over, threads, prefix = arm_overrides(Path(tmp), arm, run, steps)
                runs[arm].append(summarise(_train(Path(tmp), over, threads, prefix)))
    summary = {arm: over_runs(r) for arm, r in runs.items()}
    return {**{f"{arm}_{k}": v for arm, s in summary.items() for k, v in s.items()}, **compare(summary, runs),
            "rounds": [{arm: runs[arm][i]["step_s"] for arm in ARMS} for i in range(repeats)], "wait": WAIT}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(overlap_bench(args.steps, args.repeats), indent=2))
