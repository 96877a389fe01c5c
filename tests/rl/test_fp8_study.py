"""The FP8 KV cache study (scripts/fp8_study.py): its arms, its summary by hand, the study it keeps in
results/ and the RESULTS.md section rendered from it."""

import json

import pytest
from rlrecipe.eval.report import render_results_md, write_results_md
from rlrecipe.eval.results_store import FP8_STUDY, load_stored_study
from rlrecipe.eval.study_sections import fp8_section

import scripts.fp8_study as fp8
import scripts.study_runs as study_runs
from rlrecipe.recipe.schema import load_recipe
from scripts.fp8_study import (
    CORRECTIONS,
    KV_ARMS,
    aggregate,
    arm_args,
    keep,
    run_name,
    study_of,
    summarise_run,
)


def _overrides(args):
    assert args[:2] == ["rl", "recipes/tiny_rl.yaml"]
    return [args[i + 1] for i in range(2, len(args), 2) if args[i] == "--set"]


def test_the_arms_are_kv_cache_by_correction_on_tiny_rl():
    assert set(KV_ARMS) == {"bf16", "fp8_unit", "fp8_calibrated"}
    assert set(CORRECTIONS) == {"none", "tis", "icepop", "m2po"}
    seen = {}
    for kv in KV_ARMS:
        for corr in CORRECTIONS:
            args = arm_args(kv, corr, steps=7, seed=2)
            r = load_recipe("recipes/tiny_rl.yaml", _overrides(args)).recipe
            seen[(kv, corr)] = (r.rollout.kv_cache_dtype, r.rollout.kv_scales, r.rl.icepop.mode)
            assert r.rl.steps == 7 and r.run.seed == 2 and r.run.name == run_name(kv, corr, 7, 2)
            assert r.run.init_from == "run:tiny-sft" and r.rollout.engine == "inprocess"
    assert seen[("bf16", "none")] == ("auto", "unit", "off")
    assert seen[("fp8_unit", "tis")] == ("fp8_e4m3", "unit", "tis")
    assert seen[("fp8_calibrated", "m2po")] == ("fp8_e4m3", "calibrated", "m2po")
    assert len(set(seen.values())) == 12
    assert run_name("fp8_unit", "tis", 40, 3) == "fp8-fp8-unit-tis-n40-s3"  # the step count in the name


def _write(run, accs, gap, avg):
    run.mkdir(parents=True)
    rows = [{"step": i + 1, "reward_mean": 0.0, "accuracy": a, "mismatch_abs_logp": gap, "icepop_masked_frac": 0.01,
             "rollout_s": 1.0, "step_wall_s": 2.0} for i, a in enumerate(accs)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval" / "tiny-arith").mkdir(parents=True)
    (run / "eval" / "tiny-arith" / "summary.json").write_text(json.dumps({"avg": avg}))
    return run


def _section(md):
    """RESULTS.md's FP8 section alone (it is the last one rendered)."""
    assert md.count("## FP8 KV cache study") == 1
    return md[md.index("## FP8 KV cache study"):]


def test_summary_by_hand_and_the_section_rendered_from_the_kept_study(tmp_path):
    a = summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.002, 0.7), "fp8_unit", "icepop", 1, "done")
    b = summarise_run(_write(tmp_path / "b", [0.6] * 5 + [0.4] * 5, 0.004, 0.5), "fp8_unit", "icepop", 2, "done")
    assert a["wall_s"] == 20.0 and a["curve"]["wall_s"][:3] == [2.0, 4.0, 6.0] and not a["collapsed"]
    assert b["collapsed"]  # 20 points below its first 5 steps
    (t,) = aggregate([a, b])
    assert t["mismatch_abs_logp"] == pytest.approx(0.003) and t["eval_avg_mean"] == pytest.approx(0.6)
    assert t["collapsed"] == 1 and t["eval_avg_sd"] == pytest.approx(2 ** 0.5 * 0.1)
    plan = {"steps": 10, "seeds": [1, 2], "kv": ["fp8_unit"], "corrections": ["icepop"]}
    path = keep(study_of([a, b], plan), tmp_path / "fp8-study.png", store=tmp_path / "store")
    assert path == tmp_path / "store" / FP8_STUDY
    kept = load_stored_study(tmp_path / "store", FP8_STUDY)
    # the per-run rows are kept, their per-step curves are not (they stay in runs/ and the figure)
    assert [(r["seed"], r["collapsed"]) for r in kept["runs"]] == [(1, False), (2, True)]
    assert not any("curve" in r for r in kept["runs"]) and kept["plan"]["design"]["seeds"] == [1, 2, 3]
    text = _section(render_results_md([], fp8_study=kept))
    assert "| fp8_unit | icepop | 1 2 | 0.00300 | 0.0100 | 60.0 ± 14.1 | 1 of 2 | 20 | - |" in text
    flat = " ".join(text.split())
    assert "Run: KV cache fp8_unit; corrections icepop; seeds 1, 2; 10 steps each." in flat
    assert ("Partial: the design is KV cache bf16, fp8_unit, fp8_calibrated x corrections none, tis, icepop, "
            "m2po x seeds 1, 2, 3 at 40 steps; KV cache arms not run: bf16, fp8_calibrated; corrections not run: "
            "none, tis, m2po; seeds not run: 3; 10 steps where the design has 40.") in flat
    assert f"![mismatch and train accuracy per KV cache, against steps and wall-clock]({tmp_path}/fp8-study.png)" in text


def test_a_complete_study_is_not_called_partial_and_a_run_that_did_not_finish_is_named(tmp_path):
    row = summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.002, 0.7), "bf16", "none", 1, "done")
    rows = [{**row, "kv": kv, "correction": c, "seed": s} for s in fp8.SEEDS for kv in KV_ARMS for c in CORRECTIONS]
    plan = {"steps": fp8.STEPS, "seeds": fp8.SEEDS, "kv": list(KV_ARMS), "corrections": list(CORRECTIONS)}
    full = fp8_section(study_of(rows, plan))
    assert "Partial" not in full and full.count("| 1 2 3 |") == 12
    rows[-1] = {**rows[-1], "status": "unfinished", "collapsed": True}
    cut = " ".join(fp8_section(study_of(rows[:-2] + rows[-1:], plan)).split())
    assert ("runs of the arms above that are missing: fp8_calibrated/icepop seed 3; runs that did not finish "
            "(counted as collapses): fp8_calibrated/m2po seed 3 (unfinished).") in cut
    assert "| fp8_calibrated | m2po | 1 2 3 |" in cut and "| 1 of 3 |" in cut


def test_a_study_written_before_it_kept_its_design_still_renders(tmp_path):
    # the runs/fp8-study/study.json of a study started before the design was kept: RESULTS.md is
    # regenerated at the end of every run's evaluation, so this must not fail
    old = {"plan": {"steps": 2, "seeds": [1], "kv": ["bf16"], "corrections": ["tis"]},
           "table": [{"kv": "bf16", "correction": "tis", "seeds": [1], "mismatch_abs_logp": 0.001,
                      "icepop_masked_frac": 0.0, "eval_avg_mean": 0.5, "eval_avg_sd": None, "wall_s_mean": 3.0,
                      "collapsed": 0}]}
    (tmp_path / "runs" / "fp8-study").mkdir(parents=True)
    (tmp_path / "runs" / "fp8-study" / "study.json").write_text(json.dumps(old))
    md = write_results_md(tmp_path / "RESULTS.md", results=[], runs_dir=tmp_path / "runs", store=tmp_path / "store")
    assert "| bf16 | tis | 1 | 0.00100 | 0.0000 | 50.0 | 0 of 1 | 3 | - |" in _section(md.read_text())


def test_results_md_has_the_section_only_when_a_study_is_kept(tmp_path):
    empty = tmp_path / "no-runs"
    md = write_results_md(tmp_path / "RESULTS.md", results=[], runs_dir=empty, store=tmp_path / "store")
    assert "FP8 KV cache" not in md.read_text()
    row = summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.002, 0.7), "bf16", "none", 1, "done")
    keep(study_of([row], {"steps": 10, "seeds": [1], "kv": ["bf16"], "corrections": ["none"]}), None,
         store=tmp_path / "store")
    md = write_results_md(tmp_path / "RESULTS.md", results=[], runs_dir=empty, store=tmp_path / "store")
    assert "| bf16 | none | 1 | 0.00200 |" in _section(md.read_text())


def test_no_new_runs_summarises_the_runs_there_keeps_the_study_and_renders_results_md(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for seed in (1, 2):
        _write(tmp_path / "runs" / run_name("bf16", "icepop", 10, seed), [0.6] * 10, 0.002, 0.7)
    (tmp_path / "runs" / run_name("bf16", "icepop", 10, 1) / "run_summary.json").write_text("{}")
    # seed 2 has no run_summary.json: it did not finish; seed 3 was never started

    def no_training(*a, **k):
        raise AssertionError("--no-new-runs trained a run")

    calls = []
    monkeypatch.setattr(study_runs, "train", no_training)
    monkeypatch.setattr(study_runs, "regenerate_results", lambda: calls.append("results"))
    fp8.main(["--no-new-runs", "--steps", "10", "--seeds", "1,2,3", "--kv", "bf16", "--corrections", "icepop"])
    kept = json.loads((tmp_path / "results" / FP8_STUDY).read_text())
    assert [(r["seed"], r["status"]) for r in kept["runs"]] == [(1, "done"), (2, "unfinished")]
    assert kept["table"][0]["collapsed"] == 1 and kept["figure"] == "results/fp8-study.png"
    assert (tmp_path / "results" / "fp8-study.png").stat().st_size > 0 and calls == ["results"]
    assert "curve" in json.loads((tmp_path / "runs" / "fp8-study" / "study.json").read_text())["runs"][0]
