"""`make mismatch-study`: what each train/inference-mismatch correction does as the mismatch grows.

Five recipes (recipes/mismatch_{off,tis,icepop,seqmask,gspo}.yaml) differ only in the correction.
Each is run, with the same `rlrecipe rl` command a user would type, under a mismatch dialled from
the command line:

- noise: `rollout.stress_logit_noise` = sigma, Gaussian noise on the rollout engine's logits (a
  stress test, labelled as one: no engine does this, but it makes the mismatch a dial);
- lag: `rollout.weight_update_every` = L, the rollout engine receives weights only every L steps
  (the off-policy lag of asynchronous RL), on top of C3PO++'s partial rollouts;
- precision: `rollout.dtype`, float16 or float32 in place of the bfloat16 every other run samples
  in (the trainer computes in float32 throughout).

The noise levels are swept upward, one seed each, until the uncorrected run collapses (or the
levels run out); the headline comparison is then repeated over 3 seeds at the first level where
it collapsed (the highest level if it never did). The rules, the collapse criterion included, are
fixed here before any run; nothing is tuned to an outcome.

Finished runs are kept, so a killed study reruns only what is missing. The summary goes to
runs/mismatch-study/study.json, figures (the five corrections overlaid, per level) under
runs/mismatch-study/figures/; the study is kept in results/mismatch-study.json, from which `rlrecipe results` renders RESULTS.md's "Mismatch study".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from rlrecipe.eval.results_store import save_study

from scripts.study_runs import train

CORRECTIONS = ["off", "tis", "icepop", "seqmask", "gspo"]
DIALS = {"noise": "rollout.stress_logit_noise", "lag": "rollout.weight_update_every", "precision": "rollout.dtype",
         "async": "rl.async_lag"}  # async: scripts/async_study.py
NOISE_LEVELS = [0.0, 1.0, 2.0, 4.0, 8.0]
LAG_LEVELS = [5, 10]
PRECISIONS = ["float16", "float32"]  # the rollout's; bfloat16 is every other run's (noise 0 is its row)
HEADLINE_SEEDS = [1, 2, 3]
STUDY_DIR = Path("runs") / "mismatch-study"
WINDOW = 5  # steps averaged at the start and at the end of a run
# Collapse: the last WINDOW steps' training accuracy is more than COLLAPSE_DROP below the first
# WINDOW steps' (RL from an SFT model that already solves ~60% should only go up), or the run
# stopped on NaN/inf.
COLLAPSE_DROP = 0.10


def recipe_of(correction: str) -> str:
    return f"recipes/mismatch_{correction}.yaml"


def level_label(dial: str, level: float | str) -> str:
    return f"{dial}-{level}" if isinstance(level, str) else f"{dial}{level:g}"


def run_name(correction: str, dial: str, level: float, seed: int) -> str:
    return f"mm-{correction}-{level_label(dial, level)}-s{seed}"


def run_one(correction: str, dial: str, level: float, seed: int) -> dict:
    """Train (or keep a finished run); the run's row of the study."""
    name = run_name(correction, dial, level, seed)
    run_dir = Path("runs") / name
    value = int(level) if dial in ("lag", "async") else level  # precision: a dtype name
    args = ["rl", recipe_of(correction), "--set", f"{DIALS[dial]}={value}", "--set", f"run.seed={seed}",
            "--set", f"run.name={name}"]
    status = train(args, run_dir)  # a stopped run (the NaN guard, say) is a result, not a crash of the study
    return summarise_run(run_dir, correction, dial, level, seed, status)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarise_run(run_dir: Path, correction: str, dial: str, level: float, seed: int, status: str) -> dict:
    from rlrecipe.run.metrics_file import read_metrics  # skips a last line a kill cut short

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]
    first, last = rows[:WINDOW], rows[-WINDOW:]
    row = {"correction": correction, "dial": dial, "level": level, "seed": seed, "run": str(run_dir),
           "recipe": recipe_of(correction), "status": status, "steps": len(rows)}
    if rows:
        row.update({
            "reward_first": _mean([r["reward_mean"] for r in first]),
            "reward_final": _mean([r["reward_mean"] for r in last]),
            "accuracy_first": _mean([r["accuracy"] for r in first]),
            "accuracy_final": _mean([r["accuracy"] for r in last]),
            "grad_norm_max": max(r["grad_norm"] for r in rows),
            "grad_norm_mean": _mean([r["grad_norm"] for r in rows]),
            "masked_frac_mean": _mean([r["icepop_masked_frac"] for r in rows]),
            "mismatch_kl_mean": _mean([r["mismatch_kl"] for r in rows]),
            "entropy_final": _mean([r["entropy"] for r in last]),
            "response_len_final": _mean([r["response_len_mean"] for r in last]),
            "offpolicy_dropped_seqs": sum(r.get("offpolicy_dropped_seqs", 0.0) for r in rows),
        })
    sha = run_dir / "recipe.sha256"
    row["recipe_sha256"] = sha.read_text().strip() if sha.exists() else None
    env = run_dir / "env.json"  # the commit pins what the sha256 means: the schema resolves the recipe
    row["commit"] = json.loads(env.read_text()).get("commit") if env.exists() else None
    summary = run_dir / "eval" / "tiny-arith" / "summary.json"
    row["eval_avg"] = json.loads(summary.read_text())["avg"] if summary.exists() else None
    row["collapsed"] = collapsed(row)
    return row


def collapsed(row: dict) -> bool:
    if row["status"] != "done" or not row.get("steps"):
        return True
    return row["accuracy_final"] < row["accuracy_first"] - COLLAPSE_DROP


def _correction_order(correction: str) -> tuple[int, str]:
    """This study's corrections in their order, then any other study's (the async study's M2PO) by name."""
    return (CORRECTIONS.index(correction), "") if correction in CORRECTIONS else (len(CORRECTIONS), correction)


def aggregate(rows: list[dict]) -> list[dict]:
    """One line per (dial, level, correction): means, sd across seeds, and collapses."""
    out = []
    keys = sorted({(r["dial"], r["level"], r["correction"]) for r in rows},
                  key=lambda k: (k[0], str(k[1]) if isinstance(k[1], str) else f"{k[1]:012.4f}",
                                 _correction_order(k[2])))
    for dial, level, corr in keys:
        group = [r for r in rows if (r["dial"], r["level"], r["correction"]) == (dial, level, corr)]
        finals = [r["reward_final"] for r in group if r.get("steps")]
        evals = [r["eval_avg"] for r in group if r.get("eval_avg") is not None]
        out.append({
            "dial": dial, "level": level, "correction": corr, "seeds": sorted(r["seed"] for r in group),
            "reward_final_mean": _mean(finals), "reward_final_sd": statistics.stdev(finals) if len(finals) > 1 else None,
            "eval_avg_mean": _mean(evals) if evals else None,
            "eval_avg_sd": statistics.stdev(evals) if len(evals) > 1 else None,
            "grad_norm_max": max((r["grad_norm_max"] for r in group if r.get("steps")), default=math.nan),
            "masked_frac_mean": _mean([r["masked_frac_mean"] for r in group if r.get("steps")]),
            "mismatch_kl_mean": _mean([r["mismatch_kl_mean"] for r in group if r.get("steps")]),
            "collapsed": sum(r["collapsed"] for r in group), "recipe": recipe_of(corr),
            "recipe_sha256": sorted({r["recipe_sha256"] for r in group if r["recipe_sha256"]}),
            "commits": sorted({r["commit"] for r in group if r.get("commit")}),
        })
    return out


def plot_level(dial: str, level: float, seed: int) -> None:
    from rlrecipe.eval.plot import plot_runs

    runs = [Path("runs") / run_name(c, dial, level, seed) for c in CORRECTIONS]
    runs = [r for r in runs if (r / "metrics.jsonl").exists()]
    if runs:
        plot_runs(runs, STUDY_DIR / "figures" / f"{level_label(dial, level)}-s{seed}")


def write_study(rows: list[dict], plan: dict, study_dir: Path = STUDY_DIR) -> Path:
    study_dir.mkdir(parents=True, exist_ok=True)
    from rlrecipe.core.atomic_io import atomic_write_text

    path = study_dir / "study.json"
    atomic_write_text(path, json.dumps({"plan": plan, "collapse_rule": (
        f"train accuracy over the last {WINDOW} steps more than {COLLAPSE_DROP:.0%} (absolute) below the first "
        f"{WINDOW} steps', or the run stopped (NaN/inf guard)"), "runs": rows, "table": aggregate(rows)}, indent=1))
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--noise", default=",".join(f"{x:g}" for x in NOISE_LEVELS), help="noise levels, ascending")
    ap.add_argument("--lag", default=",".join(str(x) for x in LAG_LEVELS), help="weight-update lags ('' = none)")
    ap.add_argument("--precision", default=",".join(PRECISIONS), help="rollout dtypes beside bfloat16 ('' = none)")
    ap.add_argument("--seeds", default=",".join(str(s) for s in HEADLINE_SEEDS), help="seeds of the headline")
    ap.add_argument("--corrections", default=",".join(CORRECTIONS))
    ap.add_argument("--headline", type=float, default=None,
                    help="noise level of the headline instead of the rule's (say why in --why)")
    ap.add_argument("--why", default="", help="recorded in study.json beside an overridden headline")
    ap.add_argument("--lag-headline", action="store_true",
                    help="also every seed at the first lag where the uncorrected run collapsed (the noise rule, "
                         "applied to the lag)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    corrections = [c for c in args.corrections.split(",") if c]
    noise = [float(x) for x in args.noise.split(",") if x]
    lags = [int(x) for x in args.lag.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    if not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    rows: list[dict] = []
    precisions = [x for x in args.precision.split(",") if x]
    plan = {"noise": noise, "lag": lags, "precision": precisions, "seeds": seeds, "corrections": corrections}
    # 1. sweep the noise upward, seed 1, until the uncorrected run collapses
    headline = noise[-1] if noise else None
    for level in noise:
        level_rows = [run_one(c, "noise", level, 1) for c in corrections]
        rows += level_rows
        write_study(rows, plan)
        plot_level("noise", level, 1)
        if any(r["correction"] == "off" and r["collapsed"] for r in level_rows):
            headline = level
            break
    # 2. the headline: the same level over every seed
    if args.headline is not None:
        plan["headline_by_rule"] = headline
        plan["headline_override_why"] = args.why
        headline = args.headline
    if headline is not None:
        plan["headline"] = {"dial": "noise", "level": headline}
        for seed in seeds:
            if seed != 1:
                rows += [run_one(c, "noise", headline, seed) for c in corrections]
                write_study(rows, plan)
    # 3. staleness: the engine lags L - 1 updates behind (no noise)
    lag_headline = None
    for lag in lags:
        level_rows = [run_one(c, "lag", lag, 1) for c in corrections]
        rows += level_rows
        write_study(rows, plan)
        plot_level("lag", lag, 1)
        if lag_headline is None and any(r["correction"] == "off" and r["collapsed"] for r in level_rows):
            lag_headline = lag
    if args.lag_headline and lag_headline is not None:
        plan["lag_headline"] = {"dial": "lag", "level": lag_headline}
        for seed in seeds:
            if seed != 1:
                rows += [run_one(c, "lag", lag_headline, seed) for c in corrections]
                write_study(rows, plan)
    # 4. precision alone: the rollout in another dtype (no noise, no lag)
    for dtype in precisions:
        rows += [run_one(c, "precision", dtype, 1) for c in corrections]
        write_study(rows, plan)
        plot_level("precision", dtype, 1)
    path = write_study(rows, plan)
    print(f"study: {path}; kept as {save_study(json.loads(path.read_text()))}")
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "results"], check=False)


if __name__ == "__main__":
    main()
