"""The FP8 KV cache study (scripts/fp8_study.py): its arms, and its summary and section by hand."""

import json

import pytest

from rlrecipe.recipe.schema import load_recipe
from scripts.fp8_study import (
    CORRECTIONS,
    KV_ARMS,
    aggregate,
    arm_args,
    run_name,
    section,
    summarise_run,
    write_section,
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


def test_summary_and_section_by_hand(tmp_path):
    a = summarise_run(_write(tmp_path / "a", [0.6] * 10, 0.002, 0.7), "fp8_unit", "icepop", 1, "done")
    b = summarise_run(_write(tmp_path / "b", [0.6] * 5 + [0.4] * 5, 0.004, 0.5), "fp8_unit", "icepop", 2, "done")
    assert a["wall_s"] == 20.0 and a["curve"]["wall_s"][:3] == [2.0, 4.0, 6.0] and not a["collapsed"]
    assert b["collapsed"]  # 20 points below its first 5 steps
    (t,) = aggregate([a, b])
    assert t["mismatch_abs_logp"] == pytest.approx(0.003) and t["eval_avg_mean"] == pytest.approx(0.6)
    assert t["collapsed"] == 1 and t["eval_avg_sd"] == pytest.approx(2 ** 0.5 * 0.1)
    text = section([t], {"steps": 10, "seeds": [1, 2]})
    assert "| fp8_unit | icepop | 1 2 | 0.00300 | 0.01000 | 60.0 ± 14.1 | 20 | 1 of 2 |" in text
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n")
    write_section(text, md)
    write_section(text.replace("60.0", "61.0"), md)  # replaced, not appended twice
    assert md.read_text().count("## FP8 KV cache study") == 1 and "61.0 ± 14.1" in md.read_text()
