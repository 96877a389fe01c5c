"""The whole chain through the CLI, as a user types it: data -> sft -> rl -> eval -> results -> plot.

Tiny sizes via --set on the shipped recipes, so a broken link between stages fails here."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # subprocess-heavy: `make test-fast` leaves it out

SMALL_MODEL = ["--set", "model.tiny.hidden_size=64", "--set", "model.tiny.num_layers=2",
               "--set", "model.tiny.intermediate_size=128"]
SMALL_EVAL = ["--set", "eval.n_samples=2", "--set", "eval.max_new_tokens=40", "--set", "eval.pass_k=[1,2]"]


def cli(cwd, *args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"rlrecipe {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_tiny_chain_end_to_end(tmp_path):
    sft_recipe, rl_recipe = str(REPO / "recipes/tiny_sft.yaml"), str(REPO / "recipes/tiny_rl.yaml")
    proc = cli(tmp_path, "eval", check=False)
    assert proc.returncode == 2 and "no run yet" in proc.stderr

    cli(tmp_path, "data", "make", "tiny-arith", "--out", "data/tiny-arith", "--n-sft", "64", "--n-rl", "64",
        "--n-eval", "6")
    cli(tmp_path, "sft", sft_recipe, *SMALL_MODEL, *SMALL_EVAL, "--set", "sft.max_steps=3", "--set", "sft.batch_size=8")
    assert (tmp_path / "runs/tiny-sft/final/model.safetensors").exists()
    assert (tmp_path / "runs/tiny-sft/eval/tiny-arith/summary.json").exists()

    cli(tmp_path, "rl", rl_recipe, *SMALL_EVAL, "--set", "rl.steps=2", "--set", "rl.prompts_per_step=4",
        "--set", "rl.samples_per_prompt=2", "--set", "rl.c3po.token_budget=150", "--set", "rl.c3po.pool_capacity=8",
        "--set", "rollout.max_new_tokens=40", "--set", "rollout.max_batch=8")
    metrics = [json.loads(line) for line in (tmp_path / "runs/tiny-rl/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    env = json.loads((tmp_path / "runs/tiny-rl/env.json").read_text())
    assert env["recipe_path"] == rl_recipe and len(env["recipe_sha256"]) == 64 and env["packages"]["torch"]

    # bare eval: the latest run (tiny-rl) with its own recorded recipe
    out = cli(tmp_path, "eval", *SMALL_EVAL)
    assert "latest run" in out.stderr
    summary = json.loads((tmp_path / "runs/tiny-rl/eval/tiny-arith/summary.json").read_text())
    assert summary["n"] == 2 and summary["num_problems"] == 6
    samples = (tmp_path / "runs/tiny-rl/eval/tiny-arith/samples.jsonl").read_text().splitlines()
    assert len(samples) == 12 and all("correct" in json.loads(s) for s in samples)

    results = json.loads(cli(tmp_path, "results", "--json").stdout)
    assert {r["benchmark"] for r in results} == {"tiny-arith"} and len(results) >= 2
    assert "tiny-arith" in (tmp_path / "RESULTS.md").read_text()

    plots = cli(tmp_path, "plot", "runs/tiny-rl", "runs/tiny-sft", "--out", "plots").stdout.split()
    assert plots and all((tmp_path / p).stat().st_size > 0 for p in plots)
