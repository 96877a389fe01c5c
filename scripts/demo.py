"""`make demo`: the whole chain on a tiny model on CPU, then a short table of what it showed.

data make tiny-arith -> sft tiny_sft -> eval -> rl tiny_rl -> eval, each step the same
`rlrecipe` command a user would type, so the demo proves the commands, not a shortcut.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

SFT_RECIPE = "recipes/tiny_sft.yaml"
RL_RECIPE = "recipes/tiny_rl.yaml"
console = Console()


def rlrecipe(*args: str) -> float:
    """Run one command as a user would; its wall seconds."""
    console.rule(f"rlrecipe {' '.join(args)}")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *args])
    if proc.returncode != 0:
        console.print(f"[red]demo stopped: `rlrecipe {' '.join(args)}` exited with {proc.returncode}[/]")
        sys.exit(proc.returncode)
    return time.time() - t0


def _metrics(run: str) -> list[dict]:
    return [json.loads(line) for line in (Path("runs") / run / "metrics.jsonl").read_text().splitlines()]


def stage_times(wall: dict[str, float]) -> Table:
    """Where the demo's time went: each command's wall time, split as the runs recorded it."""
    sft, rl = _metrics("tiny-sft"), _metrics("tiny-rl")
    sft_eval, rl_eval = _summary("tiny-sft"), _summary("tiny-rl")
    sft_train = sum(r["step_s"] for r in sft)
    roll = sum(r["rollout_s"] - r.get("grade_s", 0.0) for r in rl)
    grade = sum(r.get("grade_s", 0.0) for r in rl)
    train = sum(r["train_s"] for r in rl)
    rows = [
        ("data", wall["data"], "", ""),
        ("SFT train", sft_train, sum(r["step_s"] * r["tokens_per_s"] for r in sft) / max(sft_train, 1e-9),
         "tokens/s (prompt + response)"),
        ("SFT eval", sft_eval["wall_time_s"], sft_eval["tokens_generated"] / sft_eval["wall_time_s"], "gen tokens/s"),
        ("SFT other (start, export)", wall["sft"] - sft_train - sft_eval["wall_time_s"], "", ""),
        ("RL rollout", roll, sum(r["tokens_generated"] for r in rl) / max(roll, 1e-9), "gen tokens/s"),
        ("RL grade", grade, sum(r["graded"] for r in rl) / max(grade, 1e-9), "answers/s"),
        ("RL train", train, sum(r["tokens_trained"] for r in rl) / max(train, 1e-9), "trained tokens/s"),
        ("RL eval", rl_eval["wall_time_s"], rl_eval["tokens_generated"] / rl_eval["wall_time_s"], "gen tokens/s"),
        ("RL other (start, export)", wall["rl"] - roll - grade - train - rl_eval["wall_time_s"], "", ""),
        ("results", wall["results"], "", ""),
    ]
    table = Table(title="where the time went")
    for col in ("stage", "seconds", "throughput", "of"):
        table.add_column(col, justify="right" if col in ("seconds", "throughput") else "left")
    for name, sec, rate, unit in rows:
        table.add_row(name, f"{sec:.1f}", f"{rate:,.0f}" if isinstance(rate, float) else rate, unit if rate != "" else "")
    table.add_row("total", f"{sum(wall.values()):.1f}", "", "")
    return table


def _summary(run: str, bench: str = "tiny-arith") -> dict:
    return json.loads((Path("runs") / run / "eval" / bench / "summary.json").read_text())


def _rl_totals(run: str = "tiny-rl") -> dict:
    rows = _metrics(run)
    masked = sum(r["icepop_masked_frac"] * r["tokens_trained"] for r in rows) / sum(r["tokens_trained"] for r in rows)
    return {"masked": masked, "dropped": rows[-1]["dropped_total"], "resumed": rows[-1]["resumed_total"],
            "steps": len(rows), "mismatch": sum(r["mismatch_abs_logp"] for r in rows) / len(rows)}


def main() -> None:
    t0 = time.time()
    wall = {"data": rlrecipe("data", "make", "tiny-arith", "--out", "data/tiny-arith", "--seed", "0"),
            # --overwrite: running the demo again replaces its own earlier runs
            "sft": rlrecipe("sft", SFT_RECIPE, "--overwrite"),  # ends with the held-out evaluation of the SFT model
            "rl": rlrecipe("rl", RL_RECIPE, "--overwrite"),  # ends with the held-out evaluation of the RL model
            "results": rlrecipe("results")}
    sft, rl = _summary("tiny-sft"), _summary("tiny-rl")
    teacher = json.loads(Path("data/tiny-arith/meta.json").read_text())["teacher_expected_accuracy_eval"]
    totals = _rl_totals()
    table = Table(title=f"tiny-arith held-out, avg@{rl['n']} over {rl['num_problems']} problems")
    for col in ("model", "avg@n", "± se", "pass@1", f"pass@{rl['n']}"):
        table.add_column(col)
    table.add_row("teacher (expected)", f"{teacher:.3f}", "", "", "")
    for name, s in (("SFT", sft), ("RL", rl)):
        pass_at = s["pass_at_k"]  # JSON keys: "1", ..., str(n)
        table.add_row(name, f"{s['avg']:.3f}", f"{s['stderr']:.3f}", f"{pass_at['1']:.3f}", f"{pass_at[str(s['n'])]:.3f}")
    console.print(table)
    gain = rl["avg"] - sft["avg"]
    console.print(f"RL gain over SFT: {gain:+.3f} ({gain / max(rl['stderr'], sft['stderr'], 1e-9):.1f} standard errors); "
                  f"over the teacher: {rl['avg'] - teacher:+.3f}")
    console.print(f"IcePop masked fraction {totals['masked']:.2e}, mean |logp_train - logp_infer| "
                  f"{totals['mismatch']:.4f} (bf16 rollout, fp32 trainer)")
    console.print(f"C3PO++: {totals['resumed']} rollouts resumed across steps, {totals['dropped']} dropped as stale "
                  f"over {totals['steps']} steps")
    console.print(stage_times(wall))
    console.print(f"total wall time {time.time() - t0:.0f} s; numbers recorded in RESULTS.md")


if __name__ == "__main__":
    main()
