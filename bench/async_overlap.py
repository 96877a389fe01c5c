"""Synchronous vs asynchronous RL on this CPU, side by side (`make bench-full`).

Three arms train the tiny recipe from the demo's SFT model for the same steps:
- split, synchronous and asynchronous (`rl.async_lag` 0 and 1): the rollout on a `rlrecipe serve`
  server pinned to one core with one thread, the trainer on the other core with one thread, as
  rollout and training GPUs are separate on a cluster. A synchronous step costs about rollout +
  train; an asynchronous one about the larger of the two.
- both cores, synchronous: the best synchronous use of the same machine, every phase on both cores
  (the in-process engine, two threads), as a colocated cluster runs rollout and training in turn.
Async pays on this machine only if it beats the second arm, not just the first.

    python -m bench.async_overlap          # prints the comparison as JSON
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

RECIPE = Path("recipes/tiny_rl.yaml")
MODEL = Path("runs/tiny-sft/final")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(core: int) -> list[str]:
    cores = os.cpu_count() or 1
    return ["taskset", "-c", str(core % cores)] if cores > 1 else []


def _train(out: Path, over: dict, threads: int, prefix: list[str]) -> list[dict]:
    """`rlrecipe rl` of the tiny recipe with these overrides, `threads` intra-op threads, under `prefix`
    (a core pinning); its metrics rows."""
    sets = [x for k, v in over.items() for x in ("--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}")]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([*prefix, sys.executable, "-m", "rlrecipe.cli.app", "rl", str(RECIPE), *sets], env=env,
                   check=True, capture_output=True, timeout=1800)
    rows = out / over["run.name"] / "metrics.jsonl"
    return [json.loads(line) for line in rows.read_text().splitlines()]


def _common(out: Path, name: str, lag: int, steps: int) -> dict:
    return {"run.name": name, "run.output_dir": str(out), "run.init_from": str(MODEL.resolve()), "rl.steps": steps,
            "rl.save_every": steps, "rl.async_lag": lag, "eval.benchmarks": []}


def run_one(out: Path, lag: int, steps: int) -> list[dict]:
    """One RL run of the tiny recipe through a pinned `rlrecipe serve`; its metrics rows."""
    over = {**_common(out, f"overlap-lag{lag}", lag, steps), "rollout.engine": "sglang", "rollout.dtype": "float32",
            "rollout.sglang.base_port": _free_port(), "rollout.sglang.weight_sync": "disk",
            "rollout.sglang.launch_cmd": [*_pinned(0), sys.executable, "-m", "rlrecipe.cli.app", "serve", "{model}",
                                          "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}"]}
    return _train(out, over, threads=1, prefix=_pinned(1))


def run_both_cores(out: Path, steps: int) -> list[dict]:
    """The synchronous run with both cores in each phase: the in-process engine, two threads."""
    over = {**_common(out, "overlap-both-cores", 0, steps), "rollout.engine": "inprocess"}
    return _train(out, over, threads=min(2, os.cpu_count() or 1), prefix=[])


def summarise(rows: list[dict]) -> dict:
    """Medians over the steps after the first (which pays for start-up), per step."""
    rows = rows[1:] or rows
    step = [r["rollout_s"] + r["train_s"] for r in rows]  # the step's wall time: waiting or rolling out, then training
    collect = [r.get("rollout_collect_s", r["rollout_s"]) for r in rows]
    return {"step_s": median(step), "rollout_s": median(collect), "train_s": median(r["train_s"] for r in rows),
            "wait_s": median(r["rollout_s"] for r in rows), "tokens_trained": median(r["tokens_trained"] for r in rows),
            "s_per_trained_token": sum(step) / sum(r["tokens_trained"] for r in rows)}


def overlap_bench(steps: int = 8) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sync, lagged = (summarise(run_one(Path(tmp), lag, steps)) for lag in (0, 1))
        both = summarise(run_both_cores(Path(tmp), steps))
    return {**{f"sync_{k}": v for k, v in sync.items()}, **{f"async_{k}": v for k, v in lagged.items()},
            **{f"sync_both_cores_{k}": v for k, v in both.items()},
            "async_speedup_per_step": sync["step_s"] / lagged["step_s"],
            "async_speedup_per_trained_token": sync["s_per_trained_token"] / lagged["s_per_trained_token"],
            "async_vs_sync_both_cores_per_step": both["step_s"] / lagged["step_s"],
            "async_vs_sync_both_cores_per_trained_token": both["s_per_trained_token"] / lagged["s_per_trained_token"],
            "sync_step_over_rollout_plus_train": sync["step_s"] / (sync["rollout_s"] + sync["train_s"]),
            "async_step_over_max_of_two": lagged["step_s"] / max(lagged["rollout_s"], lagged["train_s"])}


if __name__ == "__main__":
    print(json.dumps(overlap_bench(), indent=2))
