"""`make lora-study`: LoRA against full fine-tuning in RL, from the demo's SFT model, over learning rates.

Arms: full fine-tuning and LoRA rank 1, 8 and 32 on every linear layer of the blocks
(`trainer.lora.rank`, alpha 32, "all-linear"), each over a set of learning rates (LRS: a decade
apart, with half-decades near each arm's top), 3 seeds: recipes/tiny_rl.yaml run with the `rlrecipe rl`
command a user would type, `--set` the arm and its rate. "LoRA Without Regret" (Thinking Machines 2025)
found LoRA's best rate about 10x full fine-tuning's; the summary names each arm's best rate (the
highest held-out mean over seeds), the rates it cannot tell from the best, the lowest rate at which a
seed collapsed, and LoRA's best rate over full fine-tuning's. --steps sets rl.steps and enters the run
names (lora-{arm}-lr{lr / 1e-4:g}x-n{steps}-s{seed}: lr1x is tiny_rl's rate, lr0.1x 1e-5).

Per run: the held-out avg@8 at the end, train accuracy per step (the reward curve), seconds per step
(the median over the run's steps) and the bytes one push to SGLang would carry: the adapter
(final/adapter) under LoRA, the whole model (final/model.safetensors) otherwise. Finished runs are
kept, so a killed study reruns only what is missing, and a run recorded in results/lora-study.json
stands for itself where runs/ lacks it (--ignore-recorded trains it again); --no-new-runs summarises
the runs there are. Writes runs/lora-study/study.json, the figure results/lora-study.png and
results/lora-study.json, from which RESULTS.md's "LoRA study" is rendered.

    python -m scripts.lora_study [--steps 40] [--seeds 1,2,3] [--arms full,r1,r8,r32] [--lrs 1e-4,1e-3]
        [--no-new-runs] [--ignore-recorded] [--note TEXT]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from rlrecipe.eval.results_store import LORA_STUDY, STORE, load_stored_study

from scripts.mismatch_study import COLLAPSE_DROP, WINDOW, _mean, collapsed
from scripts.study_runs import collect, conclude, finish_row, finished, keep_study, write_study_json
from scripts.study_runs import sd as _sd

RECIPE = "recipes/tiny_rl.yaml"
BASE_LR = 1e-4  # tiny_rl's trainer.lr; run names give the rate as a multiple of it
ARMS = {"full": 0, "r1": 1, "r8": 8, "r32": 32}  # arm: trainer.lora.rank (0: full fine-tuning)
# Each arm's learning rates. Full fine-tuning collapsed at 1e-3, so its sweep goes down from there;
# LoRA did as well at 1e-3 as at 1e-4, so its sweep goes up to 1e-2, and down to 3e-5 once 1e-4
# turned out its best (an optimum at the lowest rate tried is no optimum).
LORA_LRS = [3e-5, 1e-4, 1e-3, 3e-3, 1e-2]
LRS = {"full": [1e-5, 3e-5, 1e-4, 3e-4, 1e-3], "r1": LORA_LRS, "r8": LORA_LRS, "r32": LORA_LRS}
SEEDS = [1, 2, 3]
STEPS = 40
STUDY_DIR = Path("runs") / "lora-study"
FIGURE = Path("results") / "lora-study.png"
COLLAPSE_RULE = (f"train accuracy over the last {WINDOW} steps more than {COLLAPSE_DROP:.0%} (absolute) below the "
                 f"first {WINDOW} steps', or the run stopped (NaN/inf guard)")


def lr_scale(lr: float) -> float:
    """The rate as a multiple of tiny_rl's, rounded off float noise (3e-5 -> 0.3, 1e-2 -> 100)."""
    return float(f"{lr / BASE_LR:.6g}")


def lr_label(lr: float) -> str:
    return f"{lr:.6g}"


def run_name(arm: str, lr: float, steps: int, seed: int) -> str:
    return f"lora-{arm}-lr{lr_scale(lr):g}x-n{steps}-s{seed}"


def arm_args(arm: str, lr: float, steps: int, seed: int) -> list[str]:
    sets = [f"trainer.lora.rank={ARMS[arm]}", f"trainer.lr={lr_label(lr)}", f"rl.steps={steps}",
            f"run.seed={seed}", f"run.name={run_name(arm, lr, steps, seed)}"]
    return ["rl", RECIPE, *[x for s in sets for x in ("--set", s)]]


def push_bytes(run_dir: Path, arm: str) -> int | None:
    """What one push to SGLang carries: the adapter's tensors, or the whole model's."""
    final = run_dir / "final"
    path = final / "adapter" / "adapter_model.safetensors" if ARMS[arm] else final / "model.safetensors"
    return path.stat().st_size if path.exists() else None


def summarise_run(run_dir: Path, arm: str, lr: float, seed: int, status: str) -> dict:
    from rlrecipe.run.metrics_file import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r] if run_dir.is_dir() else []
    row = {"arm": arm, "lr": lr, "lr_scale": lr_scale(lr), "seed": seed, "run": str(run_dir), "status": status,
           "steps": len(rows), "push_bytes": push_bytes(run_dir, arm)}
    if rows:
        row.update({"accuracy_first": _mean([r["accuracy"] for r in rows[:WINDOW]]),
                    "accuracy_final": _mean([r["accuracy"] for r in rows[-WINDOW:]]),
                    # the median: a step stalled by something else on the machine does not move it
                    "step_s": statistics.median(r["step_wall_s"] for r in rows),
                    "curve": {"step": [r["step"] for r in rows], "accuracy": [r["accuracy"] for r in rows]}})
    return finish_row(row, run_dir, collapsed)


def row_lr(row: dict) -> float:
    """A run's learning rate; the first runs recorded only their multiple of tiny_rl's."""
    return row["lr"] if row.get("lr") is not None else BASE_LR * row["lr_scale"]


def recorded_runs(steps: int, store: Path = STORE) -> dict[str, dict]:
    """The runs kept in results/lora-study.json at `steps`, by run name (their curves are not kept)."""
    kept = load_stored_study(store, LORA_STUDY) or {}
    out = {}
    for r in kept.get("runs", []):
        r = {**r, "lr": row_lr(r)}
        name = run_name(r["arm"], r["lr"], steps, r["seed"])
        never_trained = r.get("status") != "done" and not r.get("steps")  # it could not start: no result
        if r["arm"] in ARMS and Path(r["run"]).name == name and not never_trained:
            out[name] = r
    return out


def complete(rows: list[dict], points: list[tuple[str, float, int]], steps: int, recorded: dict[str, dict],
             runs: Path = Path("runs")) -> list[dict]:
    """`rows` (the runs trained now), then every other point's run there is in `runs`, then the recorded
    runs neither gave: a run directory stands before the record of the same run."""
    out, have = list(rows), {Path(r["run"]).name for r in rows}
    for arm, lr, seed in points:
        run_dir = runs / run_name(arm, lr, steps, seed)
        if run_dir.name not in have and run_dir.is_dir():
            out.append(summarise_run(run_dir, arm, lr, seed, "done" if finished(run_dir) else "unfinished"))
            have.add(run_dir.name)
    out += [r for name, r in recorded.items() if name not in have]
    return out


def aggregate(rows: list[dict]) -> list[dict]:
    """One line per (arm, learning rate), arms in their order and rates ascending: means and sd across seeds."""
    out = []
    for arm in ARMS:
        for lr in sorted({lr_scale(row_lr(r)) for r in rows if r["arm"] == arm}):
            group = [r for r in rows if r["arm"] == arm and lr_scale(row_lr(r)) == lr]
            done = [r for r in group if r.get("steps")]
            evals = [r["eval_avg"] for r in group if r.get("eval_avg") is not None]
            pushes = [r["push_bytes"] for r in group if r.get("push_bytes")]
            out.append({"arm": arm, "rank": ARMS[arm], "lr": float(f"{BASE_LR * lr:.6g}"), "lr_scale": lr,
                        "seeds": sorted(r["seed"] for r in group),
                        "eval_avg_mean": _mean(evals) if evals else None, "eval_avg_sd": _sd(evals),
                        "eval_avg_min": min(evals) if evals else None, "eval_avg_max": max(evals) if evals else None,
                        "accuracy_final": _mean([r["accuracy_final"] for r in done]) if done else None,
                        "step_s": _mean([r["step_s"] for r in done]) if done else None,
                        "push_bytes": max(pushes) if pushes else None,
                        "collapsed": sum(r["collapsed"] for r in group),
                        "commits": sorted({r["commit"] for r in group if r.get("commit")})})
    return out


def _indistinguishable(a: dict, b: dict) -> bool:
    """Two rates' held-out means less than two standard errors of their difference apart (seeds as samples)."""
    if a["eval_avg_sd"] is None or b["eval_avg_sd"] is None:
        return a["eval_avg_mean"] == b["eval_avg_mean"]
    se = math.sqrt(a["eval_avg_sd"] ** 2 / len(a["seeds"]) + b["eval_avg_sd"] ** 2 / len(b["seeds"]))
    return abs(a["eval_avg_mean"] - b["eval_avg_mean"]) <= 2 * se


def optima(table: list[dict]) -> dict:
    """Per arm: its best rate (the highest held-out mean), the rates whose mean cannot be told from the
    best's, the lowest rate with a collapsed seed, and the rates swept; LoRA's best rate over full
    fine-tuning's, and the range the indistinguishable rates allow."""
    arms = {}
    for arm in ARMS:
        lines = [t for t in table if t["arm"] == arm and t["eval_avg_mean"] is not None]
        if not lines:
            continue
        best = max(lines, key=lambda t: t["eval_avg_mean"])
        collapses = [t for t in lines if t["collapsed"]]
        arms[arm] = {"best_lr": best["lr"], "best_eval_avg_mean": best["eval_avg_mean"],
                     "best_eval_avg_sd": best["eval_avg_sd"], "best_seeds": len(best["seeds"]),
                     "near_best_lrs": [t["lr"] for t in lines if _indistinguishable(t, best)],
                     "collapse_lr": collapses[0]["lr"] if collapses else None,
                     "collapse_seeds": f"{collapses[0]['collapsed']} of {len(collapses[0]['seeds'])}" if collapses else None,
                     "lrs": [t["lr"] for t in lines]}
    ratio = {}
    if "full" in arms:
        full = arms["full"]
        for arm, a in arms.items():
            if arm != "full":
                ratio[arm] = {"best": float(f"{a['best_lr'] / full['best_lr']:.6g}"),
                              "low": float(f"{min(a['near_best_lrs']) / max(full['near_best_lrs']):.6g}"),
                              "high": float(f"{max(a['near_best_lrs']) / min(full['near_best_lrs']):.6g}")}
    return {"arms": arms, "lora_over_full": ratio}


def _arm_name(arm: str) -> str:
    return "full fine-tuning" if arm == "full" else f"LoRA rank {ARMS[arm]}"


def lr_text(lr: float) -> str:
    """1e-05 as 1e-5, 0.003 as 3e-3."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _lrs(xs: list[float]) -> str:
    return ", ".join(lr_text(x) for x in xs)


def _times(x: float) -> str:
    """A ratio of rates to two figures: 3.3x, 33x, 100x."""
    return f"{x:.2g}x" if x < 100 else f"{x:.0f}x"


def verdict(found: dict, missing: list[str], seeds: int = len(SEEDS)) -> str:
    """The sweep in words, for RESULTS.md's section."""
    arms, ratio = found["arms"], found["lora_over_full"]
    parts = ["Learning-rate sweep: " + "; ".join(f"{_arm_name(a)} at {_lrs(v['lrs'])}" for a, v in arms.items())]
    best = []
    for arm, v in arms.items():
        sd = "" if v["best_eval_avg_sd"] is None else f" ± {100 * v['best_eval_avg_sd']:.1f}"
        seeds_note = "" if v["best_seeds"] == seeds else f", {v['best_seeds']} seed{'s' * (v['best_seeds'] != 1)}"
        near = [x for x in v["near_best_lrs"] if x != v["best_lr"]]
        best.append(f"{_arm_name(arm)} {lr_text(v['best_lr'])} ({100 * v['best_eval_avg_mean']:.1f}{sd}{seeds_note}"
                    + (f"; {_lrs(near)} within two standard errors" if near else "; no other rate within two "
                       "standard errors") + ")")
    parts.append("Best rate by held-out mean: " + "; ".join(best))
    parts.append("Lowest rate with a collapsed seed: " + "; ".join(
        f"{_arm_name(a)} {lr_text(v['collapse_lr'])} ({v['collapse_seeds']})" if v["collapse_lr"] is not None
        else f"{_arm_name(a)} none up to {lr_text(max(v['lrs']))}" for a, v in arms.items()))
    if ratio:
        parts.append("LoRA's best rate over full fine-tuning's: " + "; ".join(
            f"rank {ARMS[a]} {_times(r['best'])} (the rates within two standard errors allow "
            f"{_times(r['low'])}-{_times(r['high'])})"
            for a, r in ratio.items()))
    if missing:
        parts.append("Not run: " + "; ".join(missing))
    return ". ".join(parts)


def missing_points(rows: list[dict], seeds: list[int]) -> list[str]:
    """The design's (arm, rate) points with fewer than `seeds` finished, and which seeds they lack."""
    out = []
    for arm, lrs in LRS.items():
        for lr in lrs:
            have = {r["seed"] for r in rows if r["arm"] == arm and lr_scale(row_lr(r)) == lr_scale(lr)}
            lack = [s for s in seeds if s not in have]
            if lack:
                out.append(f"{_arm_name(arm)} at {lr_text(lr)}" + ("" if len(lack) == len(seeds) else
                                                           f" seed {', '.join(map(str, lack))}"))
    return out


def study_of(rows: list[dict], plan: dict) -> dict:
    table = aggregate(rows)
    found = optima(table)
    note = ". ".join(x for x in ((plan.get("note") or "").rstrip(". "), verdict(found, missing_points(rows, SEEDS))) if x)
    return {"plan": {**plan, "note": note, "optima": found,
                     "design": {"arms": list(ARMS), "lrs": LRS, "seeds": SEEDS, "steps": STEPS, "base_lr": BASE_LR}},
            "collapse_rule": COLLAPSE_RULE, "runs": rows, "table": table}


def write_study(rows: list[dict], plan: dict) -> Path:
    return write_study_json(STUDY_DIR, study_of(rows, plan))


def keep(study: dict, figure: Path | None, store: Path = STORE) -> Path:
    return keep_study(study, figure, store, LORA_STUDY)


COLOURS = {"full": "black", "r1": "tab:blue", "r8": "tab:orange", "r32": "tab:green"}


def plot(rows: list[dict], out: Path) -> Path:
    """Held-out avg@8 against the learning rate per arm (log axis; each seed, and the mean with its sd),
    then train accuracy against steps, one panel per arm, coloured by rate (the runs whose curves are here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    fig = plt.figure(figsize=(13, 8), layout="constrained")
    grid = fig.add_gridspec(2, len(ARMS))
    ax = fig.add_subplot(grid[0, :])
    table = aggregate(rows)
    for i, arm in enumerate(ARMS):
        lines = [t for t in table if t["arm"] == arm and t["eval_avg_mean"] is not None]
        if not lines:
            continue
        shift = 1.06 ** (i - 1.5)  # arms side by side at each rate
        xs = [t["lr"] * shift for t in lines]
        ax.errorbar(xs, [100 * t["eval_avg_mean"] for t in lines],
                    yerr=[100 * (t["eval_avg_sd"] or 0) for t in lines], color=COLOURS[arm], marker="o", capsize=3,
                    label=_arm_name(arm))
        seeds = [r for r in rows if r["arm"] == arm and r.get("eval_avg") is not None]
        ax.scatter([row_lr(r) * shift for r in seeds], [100 * r["eval_avg"] for r in seeds], color=COLOURS[arm],
                   s=10, alpha=0.4)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("held-out avg@8 (%)")
    ax.set_title("held-out avg@8 against learning rate: mean ± sd over seeds, dots the seeds")
    ax.legend(loc="lower left")
    all_lrs = sorted({row_lr(r) for r in rows})
    norm = colors.LogNorm(min(all_lrs), max(all_lrs)) if len(all_lrs) > 1 else colors.LogNorm(all_lrs[0] / 10,
                                                                                                all_lrs[0] * 10)
    for i, arm in enumerate(ARMS):
        axc = fig.add_subplot(grid[1, i], sharey=None if i == 0 else fig.axes[1])
        mine = [r for r in rows if r["arm"] == arm]
        drawn = [r for r in mine if r.get("curve")]
        for r in drawn:
            axc.plot(r["curve"]["step"], r["curve"]["accuracy"], color=cm.viridis(norm(row_lr(r))), alpha=0.7, lw=1)
        # the runs kept only in results/lora-study.json have no per-step curve
        axc.set_title(_arm_name(arm) + ("" if len(drawn) == len(mine) else f" ({len(drawn)} of {len(mine)} runs' curves)"),
                      fontsize=10)
        axc.set_xlabel("step")
        if i == 0:
            axc.set_ylabel("train accuracy")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap="viridis"), ax=fig.axes[1:], label="learning rate")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--lrs", default="", help="learning rates for every arm named (default: each arm's in LRS)")
    ap.add_argument("--no-new-runs", action="store_true", help="train nothing: summarise the runs there are")
    ap.add_argument("--ignore-recorded", action="store_true",
                    help="train runs that results/lora-study.json records but runs/ lacks, and leave the records out")
    ap.add_argument("--note", default="", help="recorded in the study and RESULTS.md (e.g. why it is partial)")
    args = ap.parse_args(argv)
    if not args.no_new_runs and not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    arms = [a for a in args.arms.split(",") if a]
    if set(arms) - set(ARMS):
        sys.exit(f"arms are {', '.join(ARMS)}")
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x]
    except ValueError:
        sys.exit(f"--lrs takes learning rates (1e-4,3e-4), not {args.lrs!r}")
    if any(not lr > 0 for lr in lrs):
        sys.exit("learning rates are positive")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    chosen = [(arm, lr) for arm in arms for lr in (lrs or LRS[arm])]
    plan = {"steps": args.steps, "seeds": seeds, "arms": arms,
            "lrs": {arm: [lr for a, lr in chosen if a == arm] for arm in arms},
            **({"note": args.note} if args.note else {})}
    recorded = {} if args.ignore_recorded else recorded_runs(args.steps)
    # every point the study knows of is summarised; the chosen ones are trained where neither runs/ nor
    # the record has them, seeds outermost: a study cut short has every point at the seeds it reached
    everything = [(arm, lr, seed) for seed in sorted({*SEEDS, *seeds}) for arm in ARMS
                  for lr in sorted({*LRS[arm], *(lr for a, lr in chosen if a == arm)})]
    planned = [(d, arm_args(arm, lr, args.steps, seed), (arm, lr, seed)) for seed in seeds for arm, lr in chosen
               if (d := Path("runs") / run_name(arm, lr, args.steps, seed)).is_dir() or d.name not in recorded]

    def save(rows: list[dict]) -> Path:
        return write_study(complete(rows, everything, args.steps, recorded), plan)

    rows = collect(planned, False, summarise_run, save) if planned and not args.no_new_runs else []
    rows = complete(rows, everything, args.steps, recorded)
    if not rows:
        sys.exit("no run of the plan is there: nothing to summarise")
    conclude(rows, lambda rows: write_study(rows, plan), lambda rows: plot(rows, FIGURE), keep)


if __name__ == "__main__":
    main()
