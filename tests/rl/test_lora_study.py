"""The LoRA study (scripts/lora_study.py): its arms as recipes, its summary by hand, the study it keeps
and the RESULTS.md section rendered from it."""

import json

import pytest
from rlrecipe.eval.report import render_results_md
from rlrecipe.eval.results_store import LORA_STUDY, load_stored_study

import scripts.lora_study as study
from rlrecipe.recipe.schema import load_recipe


def _overrides(args):
    assert args[:2] == ["rl", "recipes/tiny_rl.yaml"]
    return [args[i + 1] for i in range(2, len(args), 2) if args[i] == "--set"]


def test_the_arms_are_full_and_three_ranks_at_two_learning_rates_on_tiny_rl():
    seen = {}
    for arm in study.ARMS:
        for scale in study.LR_SCALES:
            args = study.arm_args(arm, scale, steps=7, seed=2)
            r = load_recipe("recipes/tiny_rl.yaml", _overrides(args)).recipe
            seen[(arm, scale)] = (r.trainer.lora.rank, r.trainer.lr, r.trainer.lora.target_modules)
            assert r.rl.steps == 7 and r.run.seed == 2 and r.run.name == study.run_name(arm, scale, 7, 2)
            assert r.run.init_from == "run:tiny-sft"
    assert seen[("full", 1)] == (0, 1e-4, "all-linear")
    assert seen[("r8", 10)] == (8, pytest.approx(1e-3), "all-linear")
    assert len(set(seen.values())) == 8
    # full fine-tuning at tiny_rl's rate is tiny_rl itself: the LoRA field is not hashed at its default
    base = load_recipe("recipes/tiny_rl.yaml").recipe
    full = load_recipe("recipes/tiny_rl.yaml", ["trainer.lora.rank=0"]).recipe
    assert full.algorithm_sha256() == base.algorithm_sha256()


def _write(run, accs, avg, step_s, push: int, adapter: bool):
    run.mkdir(parents=True)
    rows = [{"step": i + 1, "reward_mean": 0.0, "accuracy": a, "step_wall_s": step_s} for i, a in enumerate(accs)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval" / "tiny-arith").mkdir(parents=True)
    (run / "eval" / "tiny-arith" / "summary.json").write_text(json.dumps({"avg": avg}))
    target = run / "final" / ("adapter/adapter_model.safetensors" if adapter else "model.safetensors")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * push)
    return run


def test_summary_by_hand_and_the_section_rendered_from_the_kept_study(tmp_path):
    a = study.summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.70, 2.0, 1000, True), "r8", 10, 1, "done")
    b = study.summarise_run(_write(tmp_path / "b", [0.5] * 10, 0.80, 4.0, 1000, True), "r8", 10, 2, "done")
    f = study.summarise_run(_write(tmp_path / "f", [0.6] * 10, 0.75, 3.0, 50000, False), "full", 1, 1, "done")
    assert a["push_bytes"] == 1000 and f["push_bytes"] == 50000 and a["step_s"] == 2.0
    full_row, lora_row = study.aggregate([a, b, f])
    assert (full_row["arm"], lora_row["arm"]) == ("full", "r8")
    assert lora_row["eval_avg_mean"] == pytest.approx(0.75) and lora_row["eval_avg_sd"] == pytest.approx(2 ** 0.5 * 0.05)
    assert lora_row["step_s"] == pytest.approx(3.0) and lora_row["lr"] == pytest.approx(1e-3)
    plan = {"steps": 10, "seeds": [1, 2], "arms": ["full", "r8"], "lr_scales": [1, 10]}
    path = study.keep(study.study_of([a, b, f], plan), None, store=tmp_path / "store")
    assert path == tmp_path / "store" / LORA_STUDY
    kept = load_stored_study(tmp_path / "store", LORA_STUDY)
    assert not any("curve" in r for r in kept["runs"])
    md = render_results_md([], lora_study=kept)
    text = md[md.index("## LoRA study"):]
    assert "| LoRA rank 8 | 0.001 | 1 2 | 75.0 ± 7.1 (70.0-80.0) | 0.550 | 1,000 | 3.00 | 0 of 2 | - |" in text
    assert "| full fine-tuning | 0.0001 | 1 | 75.0 (75.0-75.0) | 0.600 | 50,000 | 3.00 | 0 of 1 | - |" in text
    flat = " ".join(text.split())
    assert "Partial: not run: r1 lr x1 seed 1, r8 lr x1 seed 1, r32 lr x1 seed 1, full lr x10 seed 1," in flat
    assert "r32 lr x10 seed 3;" in flat and "r8 lr x10 seed 2" not in flat
    assert "10 steps where the design has 40" in flat
