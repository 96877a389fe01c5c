"""The LoRA study (scripts/lora_study.py): its arms as recipes, its summary by hand, the recorded runs
merged with new ones, each arm's best rate and collapse, and the RESULTS.md section rendered from the
kept study."""

import json

import pytest
from rlrecipe.eval.report import render_results_md
from rlrecipe.eval.results_store import LORA_STUDY, load_stored_study

import scripts.lora_study as study
from rlrecipe.recipe.schema import load_recipe


def _overrides(args):
    assert args[:2] == ["rl", "recipes/tiny_rl.yaml"]
    return [args[i + 1] for i in range(2, len(args), 2) if args[i] == "--set"]


def test_the_arms_are_full_and_three_ranks_each_over_its_learning_rates_on_tiny_rl():
    seen = {}
    for arm, lrs in study.LRS.items():
        assert len(lrs) >= 4 and lrs == sorted(lrs)
        for lr in lrs:
            args = study.arm_args(arm, lr, steps=7, seed=2)
            r = load_recipe("recipes/tiny_rl.yaml", _overrides(args)).recipe
            seen[(arm, lr)] = (r.trainer.lora.rank, r.trainer.lr, r.trainer.lora.target_modules)
            assert r.rl.steps == 7 and r.run.seed == 2 and r.run.name == study.run_name(arm, lr, 7, 2)
            assert r.run.init_from == "run:tiny-sft"
            assert r.trainer.lr == pytest.approx(lr, rel=1e-9)
    assert seen[("full", 1e-4)] == (0, 1e-4, "all-linear")
    assert seen[("r8", 1e-3)] == (8, pytest.approx(1e-3), "all-linear")
    assert len(set(seen.values())) == sum(len(x) for x in study.LRS.values())
    # full fine-tuning at tiny_rl's rate is tiny_rl itself: the LoRA field is not hashed at its default
    base = load_recipe("recipes/tiny_rl.yaml").recipe
    full = load_recipe("recipes/tiny_rl.yaml", ["trainer.lora.rank=0"]).recipe
    assert full.algorithm_sha256() == base.algorithm_sha256()


def test_run_names_keep_the_first_studys_and_give_fractional_multiples():
    # the first 24 runs were named by their multiple of 1e-4: 1 and 10
    assert study.run_name("full", 1e-4, 40, 1) == "lora-full-lr1x-n40-s1"
    assert study.run_name("r32", 1e-3, 40, 3) == "lora-r32-lr10x-n40-s3"
    assert study.run_name("full", 1e-5, 40, 2) == "lora-full-lr0.1x-n40-s2"
    assert study.run_name("full", 3e-5, 40, 2) == "lora-full-lr0.3x-n40-s2"
    assert study.run_name("r8", 3e-3, 40, 1) == "lora-r8-lr30x-n40-s1"
    assert study.run_name("r8", 1e-2, 40, 1) == "lora-r8-lr100x-n40-s1"
    assert study.lr_text(3e-5) == "3e-5" and study.lr_text(1e-2) == "1e-2"
    assert (study._times(1e-4 / 3e-5), study._times(10.0), study._times(100.0)) == ("3.3x", "10x", "100x")


def _write(run, accs, avg, step_s, push: int, adapter: bool):
    run.mkdir(parents=True)
    rows = [{"step": i + 1, "reward_mean": 0.0, "accuracy": a, "step_wall_s": step_s} for i, a in enumerate(accs)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval" / "tiny-arith").mkdir(parents=True)
    (run / "eval" / "tiny-arith" / "summary.json").write_text(json.dumps({"avg": avg}))
    (run / "run_summary.json").write_text("{}")
    target = run / "final" / ("adapter/adapter_model.safetensors" if adapter else "model.safetensors")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * push)
    return run


def test_summary_by_hand_and_the_section_rendered_from_the_kept_study(tmp_path):
    a = study.summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.70, 2.0, 1000, True), "r8", 1e-3, 1, "done")
    b = study.summarise_run(_write(tmp_path / "b", [0.5] * 10, 0.80, 4.0, 1000, True), "r8", 1e-3, 2, "done")
    f = study.summarise_run(_write(tmp_path / "f", [0.6] * 10, 0.75, 3.0, 50000, False), "full", 1e-4, 1, "done")
    assert a["push_bytes"] == 1000 and f["push_bytes"] == 50000 and a["step_s"] == 2.0 and a["lr_scale"] == 10
    full_row, lora_row = study.aggregate([a, b, f])
    assert (full_row["arm"], lora_row["arm"]) == ("full", "r8")
    assert lora_row["eval_avg_mean"] == pytest.approx(0.75) and lora_row["eval_avg_sd"] == pytest.approx(2 ** 0.5 * 0.05)
    assert lora_row["step_s"] == pytest.approx(3.0) and lora_row["lr"] == 1e-3
    plan = {"steps": 10, "seeds": [1, 2], "arms": ["full", "r8"]}
    path = study.keep(study.study_of([a, b, f], plan), None, store=tmp_path / "store")
    assert path == tmp_path / "store" / LORA_STUDY
    kept = load_stored_study(tmp_path / "store", LORA_STUDY)
    assert not any("curve" in r for r in kept["runs"])
    md = render_results_md([], lora_study=kept)
    text = md[md.index("## LoRA study"):]
    assert "| LoRA rank 8 | 0.001 | 1 2 | 75.0 ± 7.1 (70.0-80.0) | 0.550 | 1,000 | 3.00 | 0 of 2 | - |" in text
    assert "| full fine-tuning | 0.0001 | 1 | 75.0 (75.0-75.0) | 0.600 | 50,000 | 3.00 | 0 of 1 | - |" in text
    flat = " ".join(text.split())
    assert "Best rate by held-out mean: full fine-tuning 1e-4 (75.0, 1 seed;" in flat
    assert "LoRA rank 8 1e-3 (75.0 ± 7.1, 2 seeds;" in flat
    assert "LoRA's best rate over full fine-tuning's: rank 8 10x" in flat
    assert "Not run: full fine-tuning at 1e-5; full fine-tuning at 3e-5;" in flat
    assert "LoRA rank 8 at 1e-3 seed 3;" in flat and "full fine-tuning at 1e-4 seed 2, 3;" in flat
    assert "10 steps where the design has 40" in flat


def _line(arm, lr, evals, collapsed=0):
    return {"arm": arm, "lr": lr, "seeds": list(range(1, len(evals) + 1)), "eval_avg_mean": sum(evals) / len(evals),
            "eval_avg_sd": study._sd(evals), "collapsed": collapsed}


def test_each_arms_best_rate_its_near_rates_its_collapse_and_the_ratio_by_hand():
    table = [_line("full", 1e-5, [0.80, 0.82, 0.84]), _line("full", 1e-4, [0.90, 0.91, 0.92]),
             _line("full", 1e-3, [0.0, 0.0, 0.0], collapsed=3),
             _line("r8", 1e-4, [0.88, 0.90, 0.92]), _line("r8", 1e-3, [0.90, 0.92, 0.94]),
             _line("r8", 1e-2, [0.1, 0.5, 0.9], collapsed=1)]
    found = study.optima(table)
    full, r8 = found["arms"]["full"], found["arms"]["r8"]
    assert (full["best_lr"], full["near_best_lrs"], full["collapse_lr"], full["collapse_seeds"]) == (
        1e-4, [1e-4], 1e-3, "3 of 3")
    # 0.92 against 0.90, sd 0.02 each over 3 seeds: 2 standard errors of the difference are 0.033;
    # 1e-2's 0.5 ± 0.4 is within them too
    assert (r8["best_lr"], r8["near_best_lrs"], r8["collapse_lr"], r8["collapse_seeds"]) == (
        1e-3, [1e-4, 1e-3, 1e-2], 1e-2, "1 of 3")
    assert found["lora_over_full"]["r8"] == {"best": 10.0, "low": 1.0, "high": 100.0}
    text = study.verdict(found, [])
    assert "Lowest rate with a collapsed seed: full fine-tuning 1e-3 (3 of 3); LoRA rank 8 1e-2 (1 of 3)" in text
    assert "LoRA rank 8 1e-3 (92.0 ± 2.0; 1e-4, 1e-2 within two standard errors)" in text
    assert "rank 8 10x (the rates within two standard errors allow 1x-100x)" in text
    assert "Not run" not in text


def test_recorded_runs_stand_where_runs_lacks_them_and_a_run_directory_stands_before_its_record(tmp_path):
    store, runs = tmp_path / "results", tmp_path / "runs"
    old = [{"arm": arm, "lr_scale": scale, "seed": 1, "run": f"runs/lora-{arm}-lr{scale}x-n40-s1", "status": "done",
            "steps": 40, "eval_avg": 0.9 if scale == 1 else 0.0, "accuracy_final": 0.8, "step_s": 3.0,
            "push_bytes": 10, "collapsed": scale == 10} for arm in ("full", "r8") for scale in (1, 10)]
    old.append({**old[0], "run": "runs/lora-full-lr1x-n10-s1"})  # another length: not this study's
    # a run that stopped before its first step (it could not start) is no result: trained again, not a collapse
    old.append({**old[0], "run": "runs/lora-r1-lr0.3x-n40-s1", "arm": "r1", "lr_scale": 0.3, "status": "stopped",
                "steps": 0, "eval_avg": None, "collapsed": True})
    study.keep({"plan": {}, "table": [], "runs": old}, None, store=store)
    recorded = study.recorded_runs(40, store=store)
    assert sorted(recorded) == ["lora-full-lr10x-n40-s1", "lora-full-lr1x-n40-s1", "lora-r8-lr10x-n40-s1",
                                "lora-r8-lr1x-n40-s1"]
    assert recorded["lora-r8-lr10x-n40-s1"]["lr"] == pytest.approx(1e-3)
    # a run trained now, and a run of the design there in runs/ that replaces its record
    new = study.summarise_run(_write(runs / "lora-full-lr0.1x-n40-s1", [0.6] * 40, 0.8, 2.0, 10, False),
                              "full", 1e-5, 1, "done")
    _write(runs / "lora-r8-lr1x-n40-s1", [0.7] * 40, 0.95, 2.0, 10, True)
    points = [("full", 1e-5, 1), ("r8", 1e-4, 1), ("r8", 1e-2, 1)]
    rows = study.complete([new], points, 40, recorded, runs=runs)
    by = {r["run"].split("/")[-1]: r for r in rows}
    assert sorted(by) == ["lora-full-lr0.1x-n40-s1", "lora-full-lr10x-n40-s1", "lora-full-lr1x-n40-s1",
                          "lora-r8-lr10x-n40-s1", "lora-r8-lr1x-n40-s1"]
    assert by["lora-r8-lr1x-n40-s1"]["eval_avg"] == 0.95 and "curve" in by["lora-r8-lr1x-n40-s1"]
    assert by["lora-full-lr1x-n40-s1"]["eval_avg"] == 0.9 and "curve" not in by["lora-full-lr1x-n40-s1"]
    table = study.aggregate(rows)
    assert [(t["arm"], t["lr"]) for t in table] == [("full", 1e-5), ("full", 1e-4), ("full", 1e-3), ("r8", 1e-4),
                                                    ("r8", 1e-3)]
    assert study.plot(rows, tmp_path / "fig.png").stat().st_size > 0


def test_a_run_that_cannot_start_is_tried_again_not_counted_collapsed(tmp_path, monkeypatch, capsys):
    """A run whose command fails before its first step (an import error, say) leaves no result; one that
    stops after training (the NaN guard) is a result, judged collapsed."""
    import subprocess

    from scripts import study_runs

    run_dir = tmp_path / "lora-r1-lr0.3x-n40-s3"

    def fails_at_start(cmd, env=None):
        run_dir.mkdir(exist_ok=True)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(study_runs.subprocess, "run", fails_at_start)
    assert study_runs.train(["rl", "x"], run_dir) == "failed"
    saved = []
    with pytest.raises(SystemExit, match="nothing to summarise"):
        study_runs.collect([(run_dir, ["rl", "x"], ("r1", 3e-5, 3))], False, lambda *a: {"arm": a[1]}, saved.append)
    assert saved == [] and "no result" in capsys.readouterr().out
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.0, "accuracy": 0.1}\n')
    assert study_runs.train(["rl", "x"], run_dir) == "stopped"
