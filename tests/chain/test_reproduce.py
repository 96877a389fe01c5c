"""`make reproduce-aime`: refuses at once without GPUs; skips finished stages and resumes the rest."""

import json
import subprocess
import sys

import pytest
import torch

from rlrecipe.recipe.schema import load_recipe
from scripts import reproduce
from tests.conftest import REPO
from tests.helpers import TINY_MODEL, write_recipe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_gpus_it_stops_at_once_saying_what_it_needs():
    r = subprocess.run([sys.executable, "-m", "scripts.reproduce"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "needs CUDA GPUs" in r.stderr and "128 GPUs" in r.stderr and r.stdout == ""


def test_finished_stages_are_skipped_and_training_resumes(tmp_path):
    for name in ("x", "y"):
        (tmp_path / f"{name}.jsonl").write_text("")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "run": {"name": "chain", "output_dir": str(tmp_path / "runs")}, "model": {"tiny": TINY_MODEL},
        "eval": {"benchmarks": [{"name": "b1", "path": str(tmp_path / "x.jsonl")},
                                 {"name": "b2", "path": str(tmp_path / "y.jsonl")}]}})
    sha = load_recipe(recipe).sha256
    run = tmp_path / "runs" / "chain"
    rl, ev = ["rl", str(recipe)], ["eval", str(recipe)]
    assert not reproduce.stage_done(rl) and not reproduce.stage_done(ev)
    assert reproduce.command(rl) == rl and reproduce.command(ev) == ev  # never started: started
    # checkpoints but no final model: the stage is resumed, not skipped
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    (run / "env.json").write_text("{}")
    assert reproduce.command(rl) == [*rl, "--resume"]
    (run / "recipe.sha256").write_text(f"{sha}  {recipe}\n")
    assert not reproduce.stage_done(rl)
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    assert reproduce.stage_done(rl)
    (run / "recipe.sha256").write_text(f"{'0' * 64}  {recipe}\n")  # finished under another recipe
    assert not reproduce.stage_done(rl)
    # evaluation is done when every benchmark has a summary of this very recipe
    for name in ("b1", "b2"):
        (run / "eval" / name).mkdir(parents=True)
        (run / "eval" / name / "summary.json").write_text(json.dumps({"recipe_sha256": sha}))
    assert reproduce.stage_done(ev)
    (run / "eval" / "b2" / "summary.json").write_text("{not json")
    assert not reproduce.stage_done(ev)
    assert not reproduce.stage_done(["data", "download", "aime24"]) and not reproduce.stage_done(["results"])


def test_the_chain_names_shipped_recipes():
    for step in reproduce.STEPS:
        if step[0] in ("rl", "sft", "eval"):
            assert load_recipe(str(REPO / step[1])).recipe.eval.benchmarks, step
