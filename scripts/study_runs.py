"""What every study driver does with one run: keep it when finished, resume it when a kill cut it
short, otherwise start it over; a run that stops (the NaN guard, say) is a result, not a crash."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def finished(run_dir: Path) -> bool:
    return (run_dir / "run_summary.json").exists() and (run_dir / "eval").is_dir()


def train(args: list[str], run_dir: Path, env: dict | None = None) -> str:
    """`rlrecipe <args>` for the run in `run_dir` unless it finished; 'done', or 'stopped' when it exited
    with an error."""
    if finished(run_dir):
        return "done"
    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    args = [*args, "--resume" if resume else "--overwrite"]
    print(f"== rlrecipe {' '.join(args)}", flush=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *args], env=env)
    print(f"== {run_dir.name}: exit {proc.returncode} after {time.time() - t0:.0f}s", flush=True)
    return "done" if proc.returncode == 0 else "stopped"


def finish_row(row: dict, run_dir: Path, collapsed) -> dict:
    """A study run's row completed with its commit, its held-out avg (tiny-arith) and whether
    `collapsed` judges it collapsed."""
    env = run_dir / "env.json"
    row["commit"] = json.loads(env.read_text()).get("commit") if env.exists() else None
    summary = run_dir / "eval" / "tiny-arith" / "summary.json"
    row["eval_avg"] = json.loads(summary.read_text())["avg"] if summary.exists() else None
    row["collapsed"] = collapsed(row)
    return row


def sd(xs: list[float]) -> float | None:
    """The sample standard deviation, or None below two values."""
    return statistics.stdev(xs) if len(xs) > 1 else None
