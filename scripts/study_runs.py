"""What every study driver does with one run: keep it when finished, resume it when a kill cut it
short, otherwise start it over; a run that stops (the NaN guard, say) is a result, not a crash, but
one that stops before its first step (it could not start) is no result and is tried again next time."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def finished(run_dir: Path) -> bool:
    return (run_dir / "run_summary.json").exists() and (run_dir / "eval").is_dir()


def train(args: list[str], run_dir: Path, env: dict | None = None) -> str:
    """`rlrecipe <args>` for the run in `run_dir` unless it finished; 'done', 'stopped' when it exited
    with an error after training, 'failed' when it exited before its first step."""
    if finished(run_dir):
        return "done"
    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    args = [*args, "--resume" if resume else "--overwrite"]
    print(f"== rlrecipe {' '.join(args)}", flush=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *args], env=env)
    print(f"== {run_dir.name}: exit {proc.returncode} after {time.time() - t0:.0f}s", flush=True)
    if proc.returncode == 0:
        return "done"
    return "stopped" if trained_a_step(run_dir) else "failed"


def trained_a_step(run_dir: Path) -> bool:
    from rlrecipe.run.metrics_file import read_metrics

    return any("step" in row for row in read_metrics(run_dir / "metrics.jsonl"))


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


def collect(planned: Iterable[tuple[Path, list[str], tuple]], no_new_runs: bool,
            summarise: Callable[..., dict], save: Callable[[list[dict]], object]) -> list[dict]:
    """Each planned (run directory, `rlrecipe` arguments, its arm) trained unless finished (with
    `no_new_runs`: only those there, none trained) and summarised as summarise(run_dir, *arm,
    status); the study saved after every run, so a study cut short keeps what it reached."""
    rows: list[dict] = []
    for run_dir, args, arm in planned:
        if no_new_runs:
            if not run_dir.is_dir():
                continue
            status = "done" if finished(run_dir) else "unfinished"
        else:
            status = train(args, run_dir)
        if status == "failed":
            print(f"== {run_dir.name}: stopped before its first step, so no result; the next run of the "
                  "study tries it again", flush=True)
            continue
        rows.append(summarise(run_dir, *arm, status))
        save(rows)
    if not rows:
        sys.exit("no run of the plan is there: nothing to summarise")
    return rows


def regenerate_results() -> None:
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "results"], check=False)


def conclude(rows: list[dict], write: Callable[[list[dict]], Path], plot: Callable[[list[dict]], Path],
             keep: Callable[[dict, Path], Path]) -> None:
    """The study written, drawn and kept; where it went said; RESULTS.md regenerated from it."""
    path = write(rows)
    figure = plot(rows)
    print(f"study: {path}; figure: {figure}; kept as {keep(json.loads(path.read_text()), figure)}")
    regenerate_results()


def save_figure(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_study_json(study_dir: Path, study: dict) -> Path:
    """The study with every run's curves, in its runs/ folder (written whole or not at all)."""
    from rlrecipe.core.atomic_io import atomic_write_text

    study_dir.mkdir(parents=True, exist_ok=True)
    path = study_dir / "study.json"
    atomic_write_text(path, json.dumps(study, indent=1))
    return path


def keep_study(study: dict, figure: Path | None, store: Path, name: str) -> Path:
    """results/<name>: the study and its per-run rows without their per-step curves (they stay in
    runs/ and the figure)."""
    from rlrecipe.eval.results_store import save_study

    kept = {**study, "runs": [{k: v for k, v in r.items() if k != "curve"} for r in study["runs"]],
            "figure": figure.as_posix() if figure else None}
    return save_study(kept, store, name, also=("runs",))
