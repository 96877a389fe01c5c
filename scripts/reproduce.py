"""`make reproduce-aime`: the published AReaL-boba chain. Needs GPUs; says so at once without them.

Restartable: run it again after a failure or a kill and it skips the stages that finished under
the same recipe and resumes the interrupted one from its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def stage_done(step: list[str]) -> bool:
    """Whether a training or evaluation step already finished under the same recipe (sha256), so a
    re-run of the chain after a failure goes straight to what is left. Downloads re-check
    their files quickly; `results` always runs."""
    from rlrecipe.recipe.schema import load_recipe

    if step[0] not in ("rl", "sft", "eval"):
        return False
    loaded = load_recipe(step[1])
    run_dir = loaded.recipe.run.dir
    if step[0] == "eval":
        benches = loaded.recipe.eval.benchmarks
        return bool(benches) and all(_sha_of(run_dir / "eval" / b.name / "summary.json") == loaded.sha256
                                     for b in benches)
    recorded = run_dir / "recipe.sha256"
    return (run_dir / "final" / "config.json").exists() and recorded.exists() and \
        recorded.read_text().split()[0] == loaded.sha256


def _sha_of(summary: Path) -> str | None:
    try:
        return json.loads(summary.read_text()).get("recipe_sha256")
    except (OSError, ValueError):
        return None


def command(step: list[str]) -> list[str]:
    """A training step that was started before resumes (from its last checkpoint, if it has one);
    one never started starts (`--resume` refuses a run that never ran)."""
    from rlrecipe.recipe.schema import load_recipe

    if step[0] in ("rl", "sft") and (load_recipe(step[1]).recipe.run.dir / "env.json").is_file():
        return [*step, "--resume"]
    return list(step)


def main() -> None:
    if not torch.cuda.is_available():
        print(f"reproduce-aime needs CUDA GPUs and found none. {NEEDS}", file=sys.stderr)
        sys.exit(2)
    for step in STEPS:
        if stage_done(step):
            print(f"# done already: rlrecipe {' '.join(step)}", flush=True)
            continue
        cmd = command(step)
        print(f"$ rlrecipe {' '.join(cmd)}", flush=True)
        code = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *cmd]).returncode
        if code != 0:
            sys.exit(code)


if __name__ == "__main__":
    main()
