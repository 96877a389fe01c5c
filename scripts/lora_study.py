"""`make lora-study`: LoRA against full fine-tuning in RL, from the demo's SFT model.

Arms: full fine-tuning and LoRA rank 1, 8 and 32 on every linear layer of the blocks
(`trainer.lora.rank`, alpha 32, "all-linear"), each at tiny_rl's learning rate and at 10x it ("LoRA
Without Regret", Thinking Machines 2025, found LoRA's best rate about 10x full fine-tuning's, so both
methods get both rates), 3 seeds: recipes/tiny_rl.yaml run with the `rlrecipe rl` command a user would
type, `--set` the arm. --steps sets rl.steps and enters the run names.

Per run: the held-out avg@8 at the end, train accuracy per step (the reward curve), seconds per step
(the median over the run's steps) and the bytes one push to SGLang would carry: the adapter
(final/adapter) under LoRA, the whole model (final/model.safetensors) otherwise. Finished runs are kept, so a killed study reruns only what is
missing; --no-new-runs summarises the runs there are. Writes runs/lora-study/study.json, the figure
results/lora-study.png and results/lora-study.json, from which RESULTS.md's "LoRA study" is rendered.

    python -m scripts.lora_study [--steps 40] [--seeds 1,2,3] [--arms full,r1,r8,r32] [--lr-scales 1,10]
        [--no-new-runs] [--note TEXT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from rlrecipe.eval.results_store import LORA_STUDY, STORE

from scripts.mismatch_study import WINDOW, _mean, collapsed
from scripts.study_runs import collect, conclude, finish_row, keep_study, save_figure, write_study_json
from scripts.study_runs import sd as _sd

RECIPE = "recipes/tiny_rl.yaml"
BASE_LR = 1e-4  # tiny_rl's trainer.lr
ARMS = {"full": 0, "r1": 1, "r8": 8, "r32": 32}  # arm: trainer.lora.rank (0: full fine-tuning)
LR_SCALES = [1, 10]
SEEDS = [1, 2, 3]
STEPS = 40
STUDY_DIR = Path("runs") / "lora-study"
FIGURE = Path("results") / "lora-study.png"


def run_name(arm: str, scale: int, steps: int, seed: int) -> str:
    return f"lora-{arm}-lr{scale}x-n{steps}-s{seed}"


def arm_args(arm: str, scale: int, steps: int, seed: int) -> list[str]:
    sets = [f"trainer.lora.rank={ARMS[arm]}", f"trainer.lr={BASE_LR * scale:g}", f"rl.steps={steps}",
            f"run.seed={seed}", f"run.name={run_name(arm, scale, steps, seed)}"]
    return ["rl", RECIPE, *[x for s in sets for x in ("--set", s)]]


def push_bytes(run_dir: Path, arm: str) -> int | None:
    """What one push to SGLang carries: the adapter's tensors, or the whole model's."""
    final = run_dir / "final"
    path = final / "adapter" / "adapter_model.safetensors" if ARMS[arm] else final / "model.safetensors"
    return path.stat().st_size if path.exists() else None


def summarise_run(run_dir: Path, arm: str, scale: int, seed: int, status: str) -> dict:
    from rlrecipe.run.metrics_file import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r] if run_dir.is_dir() else []
    row = {"arm": arm, "lr_scale": scale, "seed": seed, "run": str(run_dir), "status": status, "steps": len(rows),
           "push_bytes": push_bytes(run_dir, arm)}
    if rows:
        row.update({"accuracy_first": _mean([r["accuracy"] for r in rows[:WINDOW]]),
                    "accuracy_final": _mean([r["accuracy"] for r in rows[-WINDOW:]]),
                    # the median: a step stalled by something else on the machine does not move it
                    "step_s": statistics.median(r["step_wall_s"] for r in rows),
                    "curve": {"step": [r["step"] for r in rows], "accuracy": [r["accuracy"] for r in rows]}})
    return finish_row(row, run_dir, collapsed)


def aggregate(rows: list[dict]) -> list[dict]:
    """One line per (arm, learning rate): means and sd across seeds."""
    out = []
    for arm in ARMS:
        for scale in LR_SCALES:
            group = [r for r in rows if (r["arm"], r["lr_scale"]) == (arm, scale)]
            if not group:
                continue
            done = [r for r in group if r.get("steps")]
            evals = [r["eval_avg"] for r in group if r.get("eval_avg") is not None]
            pushes = [r["push_bytes"] for r in group if r.get("push_bytes")]
            out.append({"arm": arm, "rank": ARMS[arm], "lr": BASE_LR * scale, "lr_scale": scale,
                        "seeds": sorted(r["seed"] for r in group),
                        "eval_avg_mean": _mean(evals) if evals else None, "eval_avg_sd": _sd(evals),
                        "eval_avg_min": min(evals) if evals else None, "eval_avg_max": max(evals) if evals else None,
                        "accuracy_final": _mean([r["accuracy_final"] for r in done]) if done else None,
                        "step_s": _mean([r["step_s"] for r in done]) if done else None,
                        "push_bytes": max(pushes) if pushes else None,
                        "collapsed": sum(r["collapsed"] for r in group),
                        "commits": sorted({r["commit"] for r in group if r.get("commit")})})
    return out


def study_of(rows: list[dict], plan: dict) -> dict:
    return {"plan": {**plan, "design": {"arms": list(ARMS), "lr_scales": LR_SCALES, "seeds": SEEDS,
                                        "steps": STEPS, "base_lr": BASE_LR}},
            "runs": rows, "table": aggregate(rows)}


def write_study(rows: list[dict], plan: dict) -> Path:
    return write_study_json(STUDY_DIR, study_of(rows, plan))


def keep(study: dict, figure: Path | None, store: Path = STORE) -> Path:
    return keep_study(study, figure, store, LORA_STUDY)


def plot(rows: list[dict], out: Path) -> Path:
    """Train accuracy against steps, one panel per learning rate, one colour per arm (seeds overlaid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LR_SCALES), figsize=(11, 4), sharey=True)
    colours = dict(zip(ARMS, ("black", "tab:blue", "tab:orange", "tab:green"), strict=True))
    for r in rows:
        if r.get("curve"):
            ax = axes[LR_SCALES.index(r["lr_scale"])]
            ax.plot(r["curve"]["step"], r["curve"]["accuracy"], color=colours[r["arm"]], alpha=0.6, lw=1)
    for ax, scale in zip(axes, LR_SCALES, strict=True):
        ax.set_title(f"lr {BASE_LR * scale:g}")
        ax.set_xlabel("step")
    axes[0].set_ylabel("train accuracy")
    for arm, colour in colours.items():
        axes[0].plot([], [], color=colour, label="full" if arm == "full" else f"LoRA rank {ARMS[arm]}")
    axes[0].legend()
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--lr-scales", default=",".join(map(str, LR_SCALES)))
    ap.add_argument("--no-new-runs", action="store_true", help="train nothing: summarise the runs there are")
    ap.add_argument("--note", default="", help="recorded in the study and RESULTS.md (e.g. why it is partial)")
    args = ap.parse_args(argv)
    if not args.no_new_runs and not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    arms = [a for a in args.arms.split(",") if a]
    scales = [int(x) for x in args.lr_scales.split(",") if x]
    if set(arms) - set(ARMS) or set(scales) - set(LR_SCALES):
        sys.exit(f"arms are {', '.join(ARMS)}; learning-rate scales {', '.join(map(str, LR_SCALES))}")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    plan = {"steps": args.steps, "seeds": seeds, "arms": arms, "lr_scales": scales,
            **({"note": args.note} if args.note else {})}
    # seeds outermost: a study cut short has every arm at the seeds it reached
    planned = ((Path("runs") / run_name(arm, scale, args.steps, seed), arm_args(arm, scale, args.steps, seed),
                (arm, scale, seed)) for seed in seeds for scale in scales for arm in arms)
    rows = collect(planned, args.no_new_runs, summarise_run, lambda rows: write_study(rows, plan))
    conclude(rows, lambda rows: write_study(rows, plan), lambda rows: plot(rows, FIGURE), keep)


if __name__ == "__main__":
    main()
