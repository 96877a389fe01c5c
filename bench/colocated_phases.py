"""What a colocated step's hand-overs cost on this CPU, measured through `rlrecipe serve`.

Two arms train the tiny recipe from the demo's SFT model for the same steps, both synchronous, both
with the rollout on a `rlrecipe serve` server over HTTP (float32, weights pushed by handle through
/update_weights_from_tensor, as the shipped colocated recipes push them), both on both cores (the
same OpenMP wait as bench/async_overlap.py);
they differ in one thing, `rollout.colocate`:
- shared: the server keeps its weights while the trainer trains (the split layout's calls);
- colocated: each step the server releases its KV cache and weights, the trainer reloads, updates
  and offloads, the weights are resumed, pushed, the cache flushed and resumed, and the push verified.
Each phase's seconds are the run's `colocate/*_s` metrics: the median over the steps after the first,
then over the runs. The arms run in paired rounds (one run of each per round); the ratios are the
medians of the rounds' ratios, with their range (bench/pairing.py). On a CPU the offloads move nothing (the trainer's device is the host), so these
are the calls' own cost; docs/gpu.md projects them at GPU scale.

    python -m bench.colocated_phases [--repeats 3] [--steps 5]   # prints the comparison as JSON
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from statistics import median

from bench.async_overlap import MODEL, _free_port, _train
from bench.pairing import paired, paired_ratios, ratio_summary
from rlrecipe.rl.colocate import PHASES

ARMS = ("shared", "colocated")


def arm_overrides(out: Path, arm: str, run: int, steps: int) -> dict:
    serve = [sys.executable, "-m", "rlrecipe.cli.app", "serve", "{model}", "--host", "{host}", "--port", "{port}",
             "--dtype", "{dtype}", "--enable-memory-saver"]
    return {"run.name": f"colocated-{arm}-{run}", "run.output_dir": str(out), "run.init_from": str(MODEL.resolve()),
            "rl.steps": steps, "rl.save_every": steps, "eval.benchmarks": [], "rollout.engine": "sglang",
            "rollout.dtype": "float32", "rollout.colocate": arm == "colocated",
            "rollout.sglang.base_port": _free_port(), "rollout.sglang.weight_sync": "ipc",
            "rollout.sglang.launch_cmd": serve}


def summarise(rows: list[dict]) -> dict:
    """One run: medians over the steps after the first (which pays for start-up)."""
    rows = rows[1:] or rows
    out = {"step_s": median(r["step_wall_s"] for r in rows), "train_s": median(r["train_s"] for r in rows),
           "rollout_s": median(r["rollout_s"] for r in rows)}
    for p in PHASES:
        key = f"colocate/{p}"
        if key in rows[0]:
            out[p] = median(r[key] for r in rows)
    return out


def colocated_phases_bench(steps: int = 5, repeats: int = 3) -> dict:
    arms: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(repeats):  # paired rounds: a machine that drifts drifts under both arms of a round
            for arm in ARMS:
                over = arm_overrides(Path(tmp), arm, run, steps)
                arms[arm].append(summarise(_train(Path(tmp), over, threads=2, prefix=[])))
    return {**compare(arms), "steps": steps, "repeats": repeats}


def hand_over_s(run: dict) -> float:
    """A colocated run's hand-overs: every phase but the update itself."""
    return sum(run[p] for p in PHASES if p != "update_s")


def compare(arms: dict[str, list[dict]]) -> dict:
    """Each arm's medians over its runs; the hand-overs against the colocated step; and, round by round
    (arms[arm][i] is round i's run; bench.pairing), the colocated step against the shared one and the
    colocated update against the shared step's training: the median of the rounds' ratios and their range.
    `rounds` keeps each round's figures, to see what moved when a ratio did."""
    summary = {arm: {k: median(r[k] for r in runs) for k in runs[0]} for arm, runs in arms.items()}
    c = summary["colocated"]
    hand_over = hand_over_s(c)
    rounds = [{"colocated_step_s": co["step_s"], "shared_step_s": sh["step_s"], "shared_train_s": sh["train_s"],
               **{f"colocated_{p}": co[p] for p in PHASES}, "colocated_hand_over_s": hand_over_s(co),
               "colocated_step_over_shared": co["step_s"] / sh["step_s"]}
              for co, sh in zip(arms["colocated"], arms["shared"], strict=True)]
    return {**{f"{arm}_{k}": v for arm, vals in summary.items() for k, v in vals.items()},
            "colocated_hand_over_s": hand_over, "colocated_hand_over_share_of_step": hand_over / c["step_s"],
            **paired(arms, "colocated_step_over_shared", "colocated", "shared", "step_s"),
            **ratio_summary("colocated_update_over_shared_train",
                            paired_ratios([r["update_s"] for r in arms["colocated"]],
                                          [r["train_s"] for r in arms["shared"]])),
            "rounds": rounds}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(json.dumps(colocated_phases_bench(args.steps, args.repeats), indent=2))
