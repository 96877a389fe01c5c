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
so a killed study reruns only what is missing. Writes runs/fp8-study/study.json, its table as
markdown into RESULTS.md's "FP8 KV cache study" section (runs/fp8-study/section.md too) and
runs/fp8-study/fp8-study.png.

    python -m scripts.fp8_study [--steps 40] [--seeds 1,2,3] [--kv bf16,fp8_unit,fp8_calibrated]
        [--corrections none,tis,icepop,m2po]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scripts.mismatch_study import COLLAPSE_DROP, WINDOW, _mean, collapsed
from scripts.study_runs import train

RECIPE = "recipes/tiny_rl.yaml"
KV_ARMS = {"bf16": ["rollout.kv_cache_dtype=auto"],
           "fp8_unit": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=unit"],
           "fp8_calibrated": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=calibrated"]}
CORRECTIONS = {"none": "off", "tis": "tis", "icepop": "icepop", "m2po": "m2po"}  # arm: rl.icepop.mode
SEEDS = [1, 2, 3]
STEPS = 40  # tiny_rl's
STUDY_DIR = Path("runs") / "fp8-study"
SECTION = "## FP8 KV cache study"
END = "<!-- end fp8-study -->"


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
    summary = run_dir / "eval" / "tiny-arith" / "summary.json"
    row["eval_avg"] = json.loads(summary.read_text())["avg"] if summary.exists() else None
    row["collapsed"] = collapsed(row)
    return row


def _sd(xs: list[float]) -> float | None:
    return statistics.stdev(xs) if len(xs) > 1 else None


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
                        "collapsed": sum(r["collapsed"] for r in group)})
    return out


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def section(table: list[dict], plan: dict) -> str:
    lines = [SECTION, "", f"`make fp8-study` (scripts/fp8_study.py): {RECIPE} from the demo's SFT model, "
             f"{plan['steps']} steps, seeds {', '.join(map(str, plan['seeds']))}; mismatch averaged over every "
             "step; held-out avg@8 at the end; collapse: train accuracy over the last "
             f"{WINDOW} steps more than {COLLAPSE_DROP:.0%} below the first {WINDOW} steps', or a stopped run.", "",
             "| KV cache | correction | seeds | mismatch: mean abs(log π_train − log π_infer) | IcePop-masked share | "
             "held-out avg@8 | wall s | collapsed |", "|---|---|---|---|---|---|---|---|"]
    for t in table:
        ev = "-" if t["eval_avg_mean"] is None else (
            f"{100 * t['eval_avg_mean']:.1f}" + ("" if t["eval_avg_sd"] is None else f" ± {100 * t['eval_avg_sd']:.1f}"))
        lines.append(f"| {t['kv']} | {t['correction']} | {' '.join(map(str, t['seeds']))} | "
                     f"{_f(t['mismatch_abs_logp'], '.5f')} | {_f(t['icepop_masked_frac'], '.5f')} | {ev} | "
                     f"{_f(t['wall_s_mean'], '.0f')} | {t['collapsed']} of {len(t['seeds'])} |")
    return "\n".join(lines + ["", END, ""])


def write_section(text: str, results_md: Path = Path("RESULTS.md")) -> None:
    """Replace the study's section of RESULTS.md (or append it)."""
    old = results_md.read_text() if results_md.exists() else ""
    if SECTION in old and END in old:
        start, end = old.index(SECTION), old.index(END) + len(END) + 1
        new = old[:start] + text + old[end:]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    results_md.write_text(new)


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
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


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
    args = ap.parse_args(argv)
    if not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    kvs, corrections = _list(args.kv, KV_ARMS), _list(args.corrections, CORRECTIONS)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    plan = {"steps": args.steps, "seeds": seeds, "kv": kvs, "corrections": corrections}
    rows: list[dict] = []
    STUDY_DIR.mkdir(parents=True, exist_ok=True)
    for seed in seeds:  # seeds outermost: a study cut short has every arm at the seeds it reached
        for kv in kvs:
            for corr in corrections:
                run_dir = Path("runs") / run_name(kv, corr, args.steps, seed)
                rows.append(summarise_run(run_dir, kv, corr, seed, train(arm_args(kv, corr, args.steps, seed), run_dir)))
                (STUDY_DIR / "study.json").write_text(json.dumps(
                    {"plan": plan, "runs": rows, "table": aggregate(rows)}, indent=1))
    text = section(aggregate(rows), plan)
    (STUDY_DIR / "section.md").write_text(text)
    write_section(text)
    print(f"study: {STUDY_DIR / 'study.json'}; figure: {plot(rows, STUDY_DIR / 'fp8-study.png')}")


if __name__ == "__main__":
    main()
