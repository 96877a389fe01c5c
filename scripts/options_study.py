"""`make options-study`: DAPO's dynamic sampling and overlong handling, QAE and Dr. GRPO against
tiny_rl on the tiny task, three seeds each, from the demo's SFT model.

Each arm is a shipped recipe (recipes/tiny_rl.yaml, recipes/tiny_rl_<arm>.yaml) run with the same
`rlrecipe rl` command a user would type, `--set run.seed=S`. One control beside them: tiny_rl with
`rl.adv_norm=group`, since QAE's and Dr. GRPO's baselines are per group where tiny_rl normalises
over the batch. The collapse rule is the mismatch study's, fixed before any run; nothing is tuned
to an outcome. Finished runs are kept, so a killed study reruns only what is missing. The summary
goes to runs/options-study/study.json and is kept in results/options-study.json, from which
`rlrecipe results` renders RESULTS.md's "DAPO, QAE and Dr. GRPO".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rlrecipe.eval.results_store import OPTIONS_STUDY, save_study

from scripts.mismatch_study import COLLAPSE_DROP, WINDOW, _mean, collapsed
from scripts.study_runs import finish_row, train
from scripts.study_runs import sd as _sd

# arm: (recipe, extra --set overrides)
ARMS = {
    "tiny_rl": ("recipes/tiny_rl.yaml", []),
    "dynamic_sampling": ("recipes/tiny_rl_dynamic_sampling.yaml", []),
    "overlong": ("recipes/tiny_rl_overlong.yaml", []),
    "qae": ("recipes/tiny_rl_qae.yaml", []),
    "dr_grpo": ("recipes/tiny_rl_dr_grpo.yaml", []),
    "group_control": ("recipes/tiny_rl.yaml", ["rl.adv_norm=group"]),
}
SEEDS = [1, 2, 3]
STUDY_DIR = Path("runs") / "options-study"
# what each arm shows, averaged over its steps (absent metrics are left out)
ARM_METRICS = ["ds_signal_share", "ds_groups_dropped", "ds_cap_hit", "overlong_filtered_frac",
               "overlong_penalty_mean", "adv_zero_frac", "truncated_frac", "response_len_mean"]


def run_name(arm: str, seed: int) -> str:
    return f"opt-{arm.replace('_', '-')}-s{seed}"


def run_one(arm: str, seed: int) -> dict:
    """Train and evaluate (or keep a finished run); the run's row of the study."""
    recipe, sets = ARMS[arm]
    name = run_name(arm, seed)
    run_dir = Path("runs") / name
    args = ["rl", recipe, "--set", f"run.seed={seed}", "--set", f"run.name={name}"]
    for s in sets:
        args += ["--set", s]
    return summarise_run(run_dir, arm, seed, train(args, run_dir))


def summarise_run(run_dir: Path, arm: str, seed: int, status: str) -> dict:
    from rlrecipe.run.metrics_file import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r] if run_dir.is_dir() else []
    first, last = rows[:WINDOW], rows[-WINDOW:]
    row = {"arm": arm, "seed": seed, "run": str(run_dir), "recipe": ARMS[arm][0], "sets": ARMS[arm][1],
           "status": status, "steps": len(rows)}
    if rows:
        row.update({"reward_final": _mean([r["reward_mean"] for r in last]),
                    "accuracy_first": _mean([r["accuracy"] for r in first]),
                    "accuracy_final": _mean([r["accuracy"] for r in last]),
                    "entropy_final": _mean([r["entropy"] for r in last]),
                    "tokens_generated": sum(r["tokens_generated"] for r in rows),
                    "rollout_s": sum(r["rollout_s"] for r in rows)})
        row.update({m: _mean([r[m] for r in rows]) for m in ARM_METRICS if m in rows[0]})
    sha = run_dir / "recipe.sha256"
    row["recipe_sha256"] = sha.read_text().strip() if sha.exists() else None
    return finish_row(row, run_dir, collapsed)


def aggregate(rows: list[dict]) -> list[dict]:
    """One line per arm: means and sd across seeds, collapses, the arm's own metrics."""
    out = []
    for arm in ARMS:
        group = [r for r in rows if r["arm"] == arm]
        if not group:
            continue
        done = [r for r in group if r.get("steps")]
        evals = [r["eval_avg"] for r in group if r.get("eval_avg") is not None]
        entropies = [r["entropy_final"] for r in done]
        out.append({
            "arm": arm, "recipe": ARMS[arm][0], "sets": ARMS[arm][1], "seeds": sorted(r["seed"] for r in group),
            "eval_avg_mean": _mean(evals) if evals else None, "eval_avg_sd": _sd(evals),
            "entropy_final_mean": _mean(entropies) if entropies else None, "entropy_final_sd": _sd(entropies),
            "reward_final_mean": _mean([r["reward_final"] for r in done]) if done else None,
            "tokens_generated_mean": _mean([r["tokens_generated"] for r in done]) if done else None,
            "collapsed": sum(r["collapsed"] for r in group),
            "arm_metrics": {m: _mean([r[m] for r in done]) for m in ARM_METRICS if done and all(m in r for r in done)},
            "recipe_sha256": sorted({r["recipe_sha256"] for r in group if r["recipe_sha256"]}),
            "commits": sorted({r["commit"] for r in group if r.get("commit")}),
        })
    return out


def write_study(rows: list[dict], plan: dict) -> Path:
    from rlrecipe.core.atomic_io import atomic_write_text

    STUDY_DIR.mkdir(parents=True, exist_ok=True)
    path = STUDY_DIR / "study.json"
    atomic_write_text(path, json.dumps({"plan": plan, "collapse_rule": (
        f"train accuracy over the last {WINDOW} steps more than {COLLAPSE_DROP:.0%} (absolute) below the first "
        f"{WINDOW} steps', or the run stopped (NaN/inf guard)"), "runs": rows, "table": aggregate(rows)}, indent=1))
    return path


def with_kept_arms(study: dict, rerun: list[str], why: str) -> dict:
    """The study with the arms not rerun taken from the kept results (their commits say when they
    ran), in ARMS order, and a note naming what was rerun and why."""
    from rlrecipe.eval.results_store import STORE

    kept = json.loads((STORE / OPTIONS_STUDY).read_text())
    table = {t["arm"]: t for t in kept["table"] if t["arm"] not in rerun}
    table.update({t["arm"]: t for t in study["table"]})
    plan = {**study["plan"], "arms": [a for a in ARMS if a in table], "rerun": rerun,
            "note": f"rerun at this commit: {', '.join(rerun)} ({why}); the other arms are kept from their commits"}
    return {**study, "plan": plan, "table": [table[a] for a in ARMS if a in table]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--keep-other-arms", metavar="WHY", default=None,
                    help="run only --arms and keep the other arms' rows from results/options-study.json; WHY "
                         "(why these arms were rerun) goes into RESULTS.md")
    args = ap.parse_args(argv)
    if not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        sys.exit(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    plan = {"arms": arms, "seeds": seeds}
    rows: list[dict] = []
    for seed in seeds:  # seeds outermost: a study cut short has every arm at the seeds it reached
        for arm in arms:
            rows.append(run_one(arm, seed))
            write_study(rows, plan)
    path = write_study(rows, plan)
    study = json.loads(path.read_text())
    if args.keep_other_arms:
        study = with_kept_arms(study, arms, args.keep_other_arms)
    print(f"study: {path}; kept as {save_study(study, name=OPTIONS_STUDY)}")
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "results"], check=False)


if __name__ == "__main__":
    main()
