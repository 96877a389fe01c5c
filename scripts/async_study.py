"""`make async-study`: does asynchronous RL still learn? The tiny task from the demo's SFT model,
synchronous vs `rl.async_lag` 1 and 4, with IcePop on and off, three seeds each.

The runs are the mismatch study's "off" and "icepop" arms (recipes/mismatch_{off,icepop}.yaml, which
differ only in the correction) with `--set rl.async_lag=L`; finished runs are kept, so a killed study
reruns only what is missing. The summary goes to runs/async-study/study.json and is kept in
results/async-study.json, from which `rlrecipe results` renders RESULTS.md's "Asynchronous RL".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rlrecipe.eval.results_store import ASYNC_STUDY, save_study

from scripts.mismatch_study import run_one, write_study

LAGS = [0, 1, 4]
CORRECTIONS = ["off", "icepop"]
SEEDS = [1, 2, 3]
STUDY_DIR = Path("runs") / "async-study"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lags", default=",".join(map(str, LAGS)))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--corrections", default=",".join(CORRECTIONS))
    args = ap.parse_args(argv)
    if not (Path("runs") / "tiny-sft" / "final").is_dir():
        sys.exit("the study starts from the tiny SFT model: run `make demo` (or rlrecipe sft recipes/tiny_sft.yaml) first")
    lags = [int(x) for x in args.lags.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    corrections = [c for c in args.corrections.split(",") if c]
    plan = {"async_lag": lags, "seeds": seeds, "corrections": corrections}
    rows: list[dict] = []
    for seed in seeds:
        for lag in lags:
            rows += [run_one(c, "async", lag, seed) for c in corrections]
            write_study(rows, plan, STUDY_DIR)
    path = write_study(rows, plan, STUDY_DIR)
    print(f"study: {path}; kept as {save_study(json.loads(path.read_text()), name=ASYNC_STUDY)}")
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "results"], check=False)


if __name__ == "__main__":
    main()
