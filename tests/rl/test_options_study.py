"""The options study (scripts/options_study.py): its summary by hand and its RESULTS.md section."""

import json

import pytest


def _write(run, rows, avg=None):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "recipe.sha256").write_text("cd" * 32)
    if avg is not None:
        (run / "eval" / "tiny-arith").mkdir(parents=True)
        (run / "eval" / "tiny-arith" / "summary.json").write_text(json.dumps({"avg": avg}))


def _row(step, acc, entropy, **extra):
    return {"step": step, "reward_mean": 10 * acc - 5, "accuracy": acc, "entropy": entropy, "tokens_generated": 100,
            "rollout_s": 1.0, "truncated_frac": 0.0, "response_len_mean": 30.0, **extra}


def test_options_study_summary_and_section_by_hand(tmp_path):
    from rlrecipe.eval.report import render_results_md

    from scripts.options_study import aggregate, summarise_run

    # 10 steps, entropy 0.5 then 0.3: the last 5 steps' mean is 0.3; signal share 0.8 throughout
    a = summarise_run(_write_run(tmp_path / "opt-ds-s1", 0.6, 0.3, 0.75), "dynamic_sampling", 1, "done")
    b = summarise_run(_write_run(tmp_path / "opt-ds-s2", 0.6, 0.5, 0.85), "dynamic_sampling", 2, "done")
    assert a["entropy_final"] == pytest.approx(0.3) and a["ds_signal_share"] == pytest.approx(0.8)
    assert a["eval_avg"] == 0.75 and not a["collapsed"]
    # a run that fell by more than 10 points of training accuracy collapsed
    c = summarise_run(_write_run(tmp_path / "opt-ds-s3", 0.3, 0.4, 0.5), "dynamic_sampling", 3, "done")
    assert c["collapsed"]
    (t,) = aggregate([a, b, c])
    assert t["seeds"] == [1, 2, 3] and t["collapsed"] == 1
    # held-out 0.75, 0.85, 0.5: mean 0.7, sample sd sqrt(((0.05)^2 + (0.15)^2 + (0.2)^2) / 2)
    assert t["eval_avg_mean"] == pytest.approx(0.7) and t["eval_avg_sd"] == pytest.approx((0.0325 / 1) ** 0.5)
    assert t["entropy_final_mean"] == pytest.approx(0.4)
    assert t["arm_metrics"]["ds_signal_share"] == pytest.approx(0.8)
    study = {"collapse_rule": "RULE", "table": [t]}
    study_run = {"recipe": "recipes/tiny_rl_dynamic_sampling.yaml", "model": "runs/opt-ds-s1/final", "run": "opt-ds-s1",
                 "benchmark": "tiny-arith", "avg": 0.75, "n": 8}
    md = render_results_md([study_run], [], options_study=study)
    assert "No results are recorded yet" in md  # the study's runs stay out of the main table
    line = next(x for x in md.splitlines() if x.startswith("| dynamic_sampling "))
    assert line.startswith("| dynamic_sampling | recipes/tiny_rl_dynamic_sampling.yaml | 1 2 3 | 70.0 ± 18.0 | "
                           "0.400 ± 0.100 |")
    # 10 steps x 100 tokens; 1 of the 3 seeds collapsed; the sha256's first 12 hex digits
    assert "| 0.00 | 1,000 | 0.000 | signal share 0.80, cap hit 0.00 | 1 of 3 | cdcdcdcdcdcd |" in line
    assert "Collapse: RULE." in md


def _write_run(run, final_acc, final_entropy, avg):
    rows = [_row(i + 1, 0.6 if i < 5 else final_acc, 0.5 if i < 5 else final_entropy, ds_signal_share=0.8,
                 ds_groups_dropped=2.0, ds_cap_hit=0.0) for i in range(10)]
    _write(run, rows, avg)
    return run


def test_a_partial_rerun_keeps_the_other_arms_from_the_kept_study(tmp_path, monkeypatch):
    from rlrecipe.eval import results_store

    from scripts.options_study import ARMS, with_kept_arms

    def line(arm, commit):
        return {"arm": arm, "commits": [commit], "seeds": [1, 2, 3]}

    (tmp_path / "options-study.json").write_text(json.dumps(
        {"plan": {"arms": list(ARMS)}, "table": [line(a, "old") for a in ARMS]}))
    monkeypatch.setattr(results_store, "STORE", tmp_path)
    study = with_kept_arms({"plan": {"arms": ["qae", "dr_grpo"], "seeds": [1, 2, 3]},
                            "table": [line("dr_grpo", "new"), line("qae", "new")]}, ["qae", "dr_grpo"], "a fix")
    assert [t["arm"] for t in study["table"]] == list(ARMS)  # every arm, in the study's order
    assert {t["arm"]: t["commits"][0] for t in study["table"]} == {
        a: "new" if a in ("qae", "dr_grpo") else "old" for a in ARMS}
    assert study["plan"]["rerun"] == ["qae", "dr_grpo"] and "a fix" in study["plan"]["note"]
