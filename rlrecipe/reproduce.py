"""`make reproduce-aime`: the published AReaL-boba chain. Needs GPUs; says so at once without them."""

from __future__ import annotations

import subprocess
import sys

import torch

NEEDS = ("recipes/7b_boba.yaml: 128 GPUs (16 nodes x 8 H100/H800 80GB); "
         "recipes/32b_200.yaml: 64 GPUs (8 nodes x 8). Smallest useful check: "
         "recipes/r1_distill_7b_eval.yaml on 8 GPUs (about an hour).")

STEPS = [
    ["data", "download", "boba-106k"],
    ["data", "download", "boba-200"],
    ["data", "download", "aime24"],
    ["data", "download", "aime25"],
    ["rl", "recipes/7b_boba.yaml"],
    ["eval", "recipes/7b_boba.yaml"],
    ["sft", "recipes/32b_200.yaml"],
    ["eval", "recipes/32b_200.yaml"],
    ["results"],
]


def main() -> None:
    if not torch.cuda.is_available():
        print(f"reproduce-aime needs CUDA GPUs and found none. {NEEDS}", file=sys.stderr)
        sys.exit(2)
    for step in STEPS:
        print(f"$ rlrecipe {' '.join(step)}", flush=True)
        code = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *step]).returncode
        if code != 0:
            sys.exit(code)


if __name__ == "__main__":
    main()
