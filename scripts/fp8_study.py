"""`make fp8-study`: what an FP8 KV cache in the rollout does to the train/inference mismatch and to
training, with and without its corrections, from the demo's SFT model.

Arms: the KV cache {bf16 (rollout.kv_cache_dtype auto: the rollout's bfloat16), fp8_e4m3 with unit
scales (SGLang without calibration), fp8_e4m3 with scales calibrated after every push} x the
correction {none, TIS, IcePop, M2PO} (rl.icepop.mode off / tis / icepop / m2po), each recipes/tiny_rl.yaml
run with the `rlrecipe rl` command a user would type, `--set` the arm, 3 seeds. --steps sets
rl.steps (tiny_rl's 40 by default) and enters the run names, so short trial runs never pass for
full ones.

Metrics per arm: the mismatch (mismatch_abs_logp = mean |log pi_train - log pi_infer| per token;
icepop_masked_frac, the share of tokens outside IcePop's band, computed whatever the correction),
the held-out avg@8 at the end (tiny_rl's evaluation) and collapses (the mismatch study's rule, fixed
before any run), at equal steps and against wall-clock (step_wall_s summed). Finished runs are kept,
so a killed study reruns only what is missing, and --no-new-runs only summarises the runs there are.
Writes runs/fp8-study/study.json (with every run's curves), the figure results/fp8-study.png, and
results/fp8-study.json (plan, table and per-run rows without curves), from which `rlrecipe results`
renders RESULTS.md's "FP8 KV cache study" (a partial study says so there).

    python -m scripts.fp8_study [--steps 40] [--seeds 1,2,3] [--kv bf16,fp8_unit,fp8_calibrated]
        [--corrections none,tis,icepop,m2po] [--no-new-runs] [--note TEXT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlrecipe.eval.results_store import FP8_STUDY, STORE

from scripts.mismatch_study import COLLAPSE_DROP, WINDOW, _mean, collapsed
from scripts.study_runs import collect, conclude, finish_row, keep_study, save_figure, write_study_json
from scripts.study_runs import sd as _sd

RECIPE = "recipes/tiny_rl.yaml"
KV_ARMS = {"bf16": ["rollout.kv_cache_dtype=auto"],
           "fp8_unit": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=unit"],
           "fp8_calibrated": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=calibrated"]}
CORRECTIONS = {"none": "off", "tis": "tis", "icepop": "icepop", "m2po": "m2po"}  # arm: rl.icepop.mode
SEEDS = [1, 2, 3]
STEPS = 40  # tiny_rl's
STUDY_DIR = Path("runs") / "fp8-study"
FIGURE = Path("results") / "fp8-study.png"  # kept beside results/fp8-study.json, as the async study's
COLLAPSE_RULE = (f"train accuracy over the last {WINDOW} steps more than {COLLAPSE_DROP:.0%} (absolute) below the "
                 f"first {WINDOW} steps', or the run did not finish (the NaN/inf guard stopped it, or it was cut short)")


def run_name(kv: str, correction: str, steps: int, seed: int) -> str:
    return f"fp8-{kv.replace('_', '-')}-{correction}-n{steps}-s{seed}"


def arm_args(kv: str, correction: str, steps: int, seed: int) -> list[str]:
    """The `rlrecipe rl` arguments of one run."""
    sets = [*KV_ARMS[kv], f"rl.icepop.mode={CORRECTIONS[correction]}", f"rl.steps={steps}",
            f"run.seed={seed}", f"run.name={run_name(kv, correction, steps, seed)}"]
    return ["rl", RECIPE, *[x for s in sets for x in ("--set", s)]]


def summarise_run(run_dir: Path, kv: str, correction: str, seed: int, status: str) -> dict:
    from rlrecipe.run.metrics_file import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r] if run_dir.is_dir() else []
    first, last = rows[:WINDOW], rows[-WINDOW:]
    row = {"kv": kv, "correction": correction, "seed": seed, "run": str(run_dir), "status": status,
           "steps": len(rows)}
    if rows:
        wall, clock = 0.0, []
        for r in rows:
            wall += r.get("step_wall_s", 0.0)
            clock.append(wall)
        row.update({"accuracy_first": _mean([r["accuracy"] for r in first]),
                    "accuracy_final": _mean([r["accuracy"] for r in last]),
                    "mismatch_abs_logp": _mean([r["mismatch_abs_logp"] for r in rows]),
                    "icepop_masked_frac": _mean([r["icepop_masked_frac"] for r in rows]),
                    "wall_s": wall, "rollout_s": sum(r["rollout_s"] for r in rows),
                    # per step, for the curves at equal steps and against wall-clock
                    "curve": {"step": [r["step"] for r in rows], "wall_s": clock,
                              "mismatch_abs_logp": [r["mismatch_abs_logp"] for r in rows],
                              "accuracy": [r["accuracy"] for r in rows]}})
    return finish_row(row, run_dir, collapsed)


def aggregate(rows: list[dict]) -> list[dict]:
    """One line per (kv, correction): means and sd across seeds, and collapses."""
    out = []
    for kv in KV_ARMS:
        for corr in CORRECTIONS:
            group = [r for r in rows if (r["kv"], r["correction"]) == (kv, corr)]
            if not group:
                continue
            done = [r for r in group if r.get("steps")]
            evals = [r["eval_avg"] for r in group if r.get("eval_avg") is not None]
            out.append({"kv": kv, "correction": corr, "seeds": sorted(r["seed"] for r in group),
                        "mismatch_abs_logp": _mean([r["mismatch_abs_logp"] for r in done]) if done else None,
                        "icepop_masked_frac": _mean([r["icepop_masked_frac"] for r in done]) if done else None,
                        "eval_avg_mean": _mean(evals) if evals else None, "eval_avg_sd": _sd(evals),
                        "wall_s_mean": _mean([r["wall_s"] for r in done]) if done else None,
                        "collapsed": sum(r["collapsed"] for r in group),
                        "commits": sorted({r["commit"] for r in group if r.get("commit")})})
    return out


def study_of(rows: list[dict], plan: dict) -> dict:
    """The study as kept: the plan with the full design beside it (so RESULTS.md can say what a partial
    study leaves out), the collapse rule, the per-run rows and the table."""
    return {"plan": {**plan, "design": {"kv": list(KV_ARMS), "corrections": list(CORRECTIONS), "seeds": SEEDS,
                                        "steps": STEPS}},
            "collapse_rule": COLLAPSE_RULE, "runs": rows, "table": aggregate(rows)}


def write_study(rows: list[dict], plan: dict) -> Path:
    return write_study_json(STUDY_DIR, study_of(rows, plan))


def keep(study: dict, figure: Path | None, store: Path = STORE) -> Path:
    return keep_study(study, figure, store, FP8_STUDY)


def plot(rows: list[dict], out: Path) -> Path:
    """Mismatch and train accuracy per kv arm, against steps and against wall-clock (seeds and
    corrections overlaid, one colour per kv arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    colours = dict(zip(KV_ARMS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for r in rows:
        c = r.get("curve")
        if not c:
            continue
        for col, x in enumerate(("step", "wall_s")):
            for row_i, y in enumerate(("mismatch_abs_logp", "accuracy")):
                axes[row_i][col].plot(c[x], c[y], color=colours[r["kv"]], alpha=0.5, lw=1)
    for col, x in enumerate(("step", "wall-clock s")):
        axes[1][col].set_xlabel(x)
    axes[0][0].set_ylabel("|log π_train − log π_infer|")
    axes[1][0].set_ylabel("train accuracy")
    for kv, colour in colours.items():
        axes[0][0].plot([], [], color=colour, label=kv)
    axes[0][0].legend()
    return save_figure(fig, out)


def _list(value: str, known) -> list[str]:
    items = [x for x in value.split(",") if x]
    unknown = sorted(set(items) - set(known))
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {', '.join(known)}")
    return items


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="rl.steps of every run")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--kv", default=",".join(KV_ARMS))
    ap.add_argument("--corrections", default=",".join(CORRECTIONS))
    ap.add_argument("--no-new-runs", action="store_true",
                    help="train nothing: summarise the runs of the plan that are there (a run that did not finish "
                         "counts as a collapse, one never started is left out), keep the study, render RESULTS.md")
    ap.add_argument("--note", default="", help="recorded in the study and RESULTS.md (e.g. why it is partial)")
    args = ap.parse_args(argv)
    if not args.no_new_runs and not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    kvs, corrections = _list(args.kv, KV_ARMS), _list(args.corrections, CORRECTIONS)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    plan = {"steps": args.steps, "seeds": seeds, "kv": kvs, "corrections": corrections,
            **({"note": args.note} if args.note else {})}
    # seeds outermost: a study cut short has every arm at the seeds it reached
    planned = ((Path("runs") / run_name(kv, corr, args.steps, seed), arm_args(kv, corr, args.steps, seed),
                (kv, corr, seed)) for seed in seeds for kv in kvs for corr in corrections)
    rows = collect(planned, args.no_new_runs, summarise_run, lambda rows: write_study(rows, plan))
    conclude(rows, lambda rows: write_study(rows, plan), lambda rows: plot(rows, FIGURE), keep)


if __name__ == "__main__":
    main()
