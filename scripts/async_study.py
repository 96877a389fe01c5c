"""`make async-study`: does asynchronous RL pay on this machine, at equal accuracy? The tiny task from the
demo's SFT model, synchronous vs `rl.async_lag` 1 and 2, each with IcePop, TIS and M2PO, three seeds,
held-out accuracy against wall-clock time as well as against steps.

Arms: the mismatch study's "icepop" and "tis" recipes and recipes/mismatch_m2po.yaml (which differ only in
the correction) with `--set rl.async_lag=L` and training-time validation every `EVAL_EVERY` steps
(`rl.eval_every`: avg@8 on the held-out tiny-arith problems, the final evaluation's settings). TIS here is
the cap on pi_old/pi_infer, which under a lag is AReaL's decoupled PPO weight pi_prox/pi_behav truncated:
pi_old is recomputed under the trainer's current weights (the proximal policy), pi_infer is what the
rollout engine sampled with (the behaviour policy, L versions older). The synchronous arm is the best
synchronous use of the 2 cores: the in-process engine, two threads in every phase; the asynchronous arms
run the same engine on a worker thread beside the trainer, on the same two cores.

Wall-clock: each step's `step_wall_s` (the RL loop's time from one metrics row to the next, validation
left out). Before a validation an asynchronous run waits for the batches its worker collects ahead
(`validation_drain_s`); that wait is counted (it is rollout work that would otherwise overlap training),
so the time axis is slightly pessimistic for async; the table shows the total drain beside it. Per arm:
the wall-clock at which the seed-mean held-out accuracy first reaches the synchronous arm's final one (same
correction), or "never" within the run's steps. Nothing here is tuned to an outcome: arms, seeds, steps
and the rule were fixed before any run.

Finished runs are kept, so a killed study reruns only what is missing. runs/async-study/study.json, the
figure results/async-study.png, and results/async-study.json, from which `rlrecipe results` renders
RESULTS.md's "Asynchronous RL".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rlrecipe.eval.results_store import ASYNC_STUDY, save_study

from scripts.mismatch_study import recipe_of, summarise_run, write_study
from scripts.study_runs import finished
from scripts.study_runs import train as run_arm

LAGS = [0, 1, 2]
CORRECTIONS = ["icepop", "tis", "m2po"]
SEEDS = [1, 2, 3]
EVAL_EVERY = 5
# Every arm under one OpenMP wait, fixed before the runs: the runtime's own default spin, stated
# explicitly so the package's load-dependent choice at start cannot differ between arms (an earlier
# cut of the study ran its seeds under different waits, which moved the synchronous arm 1.7x).
STUDY_WAIT = {"GOMP_SPINCOUNT": "300000"}
STUDY_DIR = Path("runs") / "async-study"
FIGURE = Path("results") / "async-study.png"


def run_name(correction: str, lag: int, seed: int) -> str:
    return f"as-{correction}-lag{lag}-s{seed}"


def run_one(correction: str, lag: int, seed: int, eval_every: int = EVAL_EVERY, train: bool = True) -> dict | None:
    """Train one arm and seed (or keep a finished run); its row, with its curve. With `train` False, only
    a finished run's row (None for a run not finished)."""
    name = run_name(correction, lag, seed)
    run_dir = Path("runs") / name
    if not finished(run_dir) and not train:
        return None
    args = ["rl", recipe_of(correction), "--set", f"rl.async_lag={lag}", "--set", f"rl.eval_every={eval_every}",
            "--set", f"run.seed={seed}", "--set", f"run.name={name}"]
    env = {**os.environ, **STUDY_WAIT, "OMP_NUM_THREADS": str(min(2, os.cpu_count() or 1))}
    env.pop("OMP_WAIT_POLICY", None)
    status = run_arm(args, run_dir, env)
    row = summarise_run(run_dir, correction, "async", lag, seed, status)
    row["curve"] = curve(run_dir)
    return row


def curve(run_dir: Path) -> list[dict]:
    """Held-out accuracy at each validation: step, wall-clock so far (with and without the drains)."""
    from rlrecipe.run.metrics_file import read_metrics

    wall = drain = 0.0
    out = []
    path = run_dir / "metrics.jsonl"
    for r in read_metrics(path) if path.exists() else []:
        wall += r.get("step_wall_s", r.get("rollout_s", 0.0) + r.get("train_s", 0.0))
        drain += r.get("validation_drain_s", 0.0)
        val = next((v for k, v in r.items() if k.startswith("val/") and k.endswith("/avg")), None)
        if val is not None:
            out.append({"step": r["step"], "wall_s": wall, "drain_s": drain, "avg": val})
    return out


def mean_curve(rows: list[dict]) -> list[dict]:
    """Per validation step, over the seeds that reached it: mean wall-clock and held-out accuracy."""
    steps = sorted({p["step"] for r in rows for p in r.get("curve", [])})
    out = []
    for s in steps:
        pts = [p for r in rows for p in r.get("curve", []) if p["step"] == s]
        avgs = [p["avg"] for p in pts]
        out.append({"step": s, "seeds": len(pts), "wall_s": statistics.mean(p["wall_s"] for p in pts),
                    "drain_s": statistics.mean(p["drain_s"] for p in pts), "avg": statistics.mean(avgs),
                    "avg_sd": statistics.stdev(avgs) if len(avgs) > 1 else None})
    return out


def first_reaching(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["avg"] >= target - 1e-12), None)


def time_table(rows: list[dict]) -> list[dict]:
    """Per (lag, correction): the seed-mean curve, s per step, and the wall-clock to reach the synchronous
    arm's final held-out accuracy (same correction; seed means), or None (never within the run)."""
    out = []
    for corr in sorted({r["correction"] for r in rows}, key=CORRECTIONS.index):
        arms = {lag: [r for r in rows if r["correction"] == corr and r["level"] == lag]
                for lag in sorted({r["level"] for r in rows if r["correction"] == corr})}
        sync = mean_curve(arms.get(0, []))
        target = sync[-1]["avg"] if sync else None
        for lag, group in arms.items():
            mc = mean_curve(group)
            hit = first_reaching(mc, target) if target is not None else None
            per_seed = [first_reaching(r.get("curve", []), target) for r in group] if target is not None else []
            last = mc[-1] if mc else None
            out.append({
                "correction": corr, "lag": lag, "seeds": sorted(r["seed"] for r in group),
                "target_avg": target, "curve": mc,
                "s_per_step": (last["wall_s"] / last["step"]) if last else None,
                "wall_s_total": last["wall_s"] if last else None, "drain_s_total": last["drain_s"] if last else None,
                "final_avg": last["avg"] if last else None, "final_avg_sd": last["avg_sd"] if last else None,
                "reach_wall_s": hit["wall_s"] if hit else None, "reach_step": hit["step"] if hit else None,
                "seeds_reaching": sum(p is not None for p in per_seed),
                "reach_wall_s_seeds": [None if p is None else p["wall_s"] for p in per_seed],
                # the machine's speed drifts between runs: each seed's own seconds per step
                "s_per_step_seeds": [r["curve"][-1]["wall_s"] / r["curve"][-1]["step"] if r.get("curve") else None
                                     for r in group],
            })
    return out


def plot(table: list[dict], out: Path = FIGURE) -> Path | None:
    """Held-out avg@8 (seed means) against wall-clock and against steps, one line per arm."""
    if not any(t["curve"] for t in table):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    styles = {0: "-", 1: "--", 2: ":"}
    colours = {"icepop": "tab:blue", "tis": "tab:orange", "m2po": "tab:green"}
    for t in table:
        label = ("sync" if not t["lag"] else f"async L={t['lag']}") + f", {t['correction']}"
        ys = [100 * p["avg"] for p in t["curve"]]
        kw = {"linestyle": styles.get(t["lag"], "-."), "color": colours.get(t["correction"]), "marker": "o",
              "markersize": 3, "label": label}
        axes[0].plot([p["wall_s"] for p in t["curve"]], ys, **kw)
        axes[1].plot([p["step"] for p in t["curve"]], ys, **kw)
    for t in table:
        if not t["lag"] and t["target_avg"] is not None:
            for ax in axes:
                ax.axhline(100 * t["target_avg"], color=colours.get(t["correction"]), linewidth=0.5, alpha=0.5)
    axes[0].set_xlabel("wall-clock of training, s (validation left out)")
    axes[1].set_xlabel("step")
    axes[0].set_ylabel("held-out avg@8, % (mean of seeds)")
    axes[1].legend(fontsize=8)
    fig.suptitle("tiny-arith from the SFT model: sync (in-process, 2 cores) vs rl.async_lag 1, 2")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lags", default=",".join(map(str, LAGS)))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--corrections", default=",".join(CORRECTIONS))
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    ap.add_argument("--note", default="", help="recorded in the study beside the plan (e.g. what was cut, and why)")
    ap.add_argument("--no-new-runs", action="store_true",
                    help="summarise the finished runs of the plan only (a study cut short: say what in --note)")
    args = ap.parse_args(argv)
    if not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    lags = [int(x) for x in args.lags.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    corrections = [c for c in args.corrections.split(",") if c]
    plan = {"async_lag": lags, "seeds": seeds, "corrections": corrections, "eval_every": args.eval_every,
            "sync_layout": "in-process engine, 2 threads", "openmp_wait": STUDY_WAIT, "note": args.note}
    rows: list[dict] = []
    path = STUDY_DIR / "study.json"
    for seed in seeds:  # seed by seed: a study cut short still compares every arm
        for lag in lags:
            new = [run_one(c, lag, seed, args.eval_every, train=not args.no_new_runs) for c in corrections]
            rows += [r for r in new if r is not None]
            if rows:
                path = finish(rows, plan)
    print(f"study: {path}; kept as {save_study(json.loads(path.read_text()), name=ASYNC_STUDY)}")
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "results"], check=False)


def finish(rows: list[dict], plan: dict) -> Path:
    """study.json with the equal-step table, the time table and the figure."""
    path = write_study(rows, plan, STUDY_DIR)
    study = json.loads(path.read_text())
    study["time_table"] = time_table(rows)
    fig = plot(study["time_table"])
    study["figure"] = fig.as_posix() if fig else None
    from rlrecipe.core.atomic_io import atomic_write_text

    atomic_write_text(path, json.dumps(study, indent=1))
    return path


if __name__ == "__main__":
    main()
