"""Results kept in the repository: RESULTS.md never loses a row because a run directory is absent,
and a local result replaces a kept one only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlrecipe.eval.recording import refresh_results
from rlrecipe.eval.report import write_results_md
from rlrecipe.eval.results_store import load_records, load_stored_study, save_record, save_study

from rlrecipe.core.errors import UserError
from tests.eval.test_report import _summary

STUDY = {"collapse_rule": "accuracy fell", "plan": {"headline": {"dial": "lag", "level": 10.0}},
         "table": [{"dial": "lag", "level": 10.0, "correction": "icepop", "seeds": [1, 2], "reward_final_mean": 1.25,
                    "reward_final_sd": 0.5, "eval_avg_mean": 0.639, "eval_avg_sd": 0.102, "grad_norm_max": 1.31,
                    "masked_frac_mean": 0.0133, "mismatch_kl_mean": 0.0335, "collapsed": 0,
                    "recipe": "recipes/mismatch_icepop.yaml", "recipe_sha256": ["f" * 64, "e" * 64],
                    "commits": ["abcdef0123"]}],
         "runs": [{"detail": "not kept"}]}


def _row(md: str, first_cell: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(f"| {first_cell}"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_kept_results_and_study_render_without_any_run_directory(tmp_path):
    runs, store = tmp_path / "runs", tmp_path / "results"
    _summary(runs, "boba", "aime24")
    study_path = runs / "mismatch-study" / "study.json"
    study_path.parent.mkdir(parents=True)
    study_path.write_text(json.dumps(STUDY))
    refresh_results(runs, store, None, record=True)
    assert [r["benchmark"] for r in load_records(store)] == ["aime24"]
    assert "runs" not in load_stored_study(store)  # per-run detail stays in the run directory

    before = write_results_md(tmp_path / "with-runs.md", runs_dir=runs, store=store).read_text()
    import shutil

    shutil.rmtree(runs)  # a fresh clone: no run directories at all
    after = write_results_md(tmp_path / "fresh.md", runs_dir=runs, store=store).read_text()
    assert after == before
    row = _row(after, "recipes/7b_boba.yaml")
    assert row[2:4] == ["aime24", "60.0 ± 1.2"]
    study_row = _row(after, "lag L=10")
    assert study_row[1:5] == ["icepop", "1 2", "1.25 ± 0.50", "63.9 ± 10.2"] and study_row[-2] == "ffffffffffff eeeeeeeeeeee"


def test_a_new_local_result_replaces_the_kept_one_only_when_asked(tmp_path, capsys):
    runs, store = tmp_path / "runs", tmp_path / "results"
    _summary(runs, "boba", "aime24")
    refresh_results(runs, store, None, record=True)
    _summary(runs, "boba", "aime24", avg=0.7, date="2025-07-01T00:00:00+00:00")  # rerun: a new number
    capsys.readouterr()

    md = write_results_md(tmp_path / "R.md", runs_dir=runs, store=store).read_text()
    assert _row(md, "recipes/7b_boba.yaml")[3] == "60.0 ± 1.2"  # the kept result still shown
    refresh_results(runs, store, None)
    err = " ".join(capsys.readouterr().err.split())
    assert "differs from the kept result of recipes/7b_boba.yaml on aime24" in err and "--record" in err
    assert [r["avg"] for r in load_records(store)] == [0.6]

    refresh_results(runs, store, None, record=True)
    assert [r["avg"] for r in load_records(store)] == [0.7]
    md = write_results_md(tmp_path / "R.md", runs_dir=runs, store=store).read_text()
    assert _row(md, "recipes/7b_boba.yaml")[3] == "70.0 ± 1.2"


def test_a_local_result_the_store_lacks_is_shown_and_marked(tmp_path):
    runs, store = tmp_path / "runs", tmp_path / "results"
    _summary(runs, "boba", "aime24")
    save_record({**json.loads((runs / "boba/eval/aime24/summary.json").read_text()), "benchmark": "aime25"}, store)
    md = write_results_md(tmp_path / "R.md", runs_dir=runs, store=store).read_text()
    rows = [line for line in md.splitlines() if line.startswith("| recipes/7b_boba.yaml") and "runs/boba" in line]
    assert [r.split("|")[3].strip() for r in rows] == ["aime24", "aime25"]
    assert rows[0].startswith("| recipes/7b_boba.yaml * |") and rows[1].startswith("| recipes/7b_boba.yaml |")
    assert "not yet kept in `results/`" in md


def test_a_damaged_kept_record_is_one_error_naming_it(tmp_path):
    store = tmp_path / "results"
    path = save_record({"recipe": "r.yaml", "model": "m", "benchmark": "b", "avg": 0.5}, store)
    path.write_text(path.read_text()[:-8])
    with pytest.raises(UserError, match=str(path)):
        load_records(store)
    path.write_text(json.dumps({"recipe": "r.yaml", "model": "m", "benchmark": "b"}))
    with pytest.raises(UserError, match=f"{path}: missing field 'avg'"):
        load_records(store)
    save_study(STUDY, store)
    (store / "mismatch-study.json").write_text("{")
    with pytest.raises(UserError, match="mismatch-study.json"):
        load_stored_study(store)


def test_the_kept_records_are_small_and_name_what_they_hold():
    root = Path(__file__).resolve().parents[2] / "results"
    for path in sorted((root / "records").glob("*.json")):
        record = json.loads(path.read_text())
        assert path.stat().st_size < 4096 and "per_problem" not in record
        assert path.name.startswith(Path(record["recipe"]).stem + "__")


def test_the_async_study_is_kept_and_rendered_in_its_own_section(tmp_path):
    runs, store = tmp_path / "runs", tmp_path / "results"
    table = [{**STUDY["table"][0], "dial": "async", "level": lvl, "correction": corr, "collapsed": lvl // 4}
             for lvl in (4, 0, 1) for corr in ("icepop", "off")]
    local = runs / "async-study" / "study.json"
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps({**STUDY, "table": table}))
    refresh_results(runs, store, None, record=True)
    assert load_stored_study(store, "async-study.json")["table"] == table
    import shutil

    shutil.rmtree(runs)
    md = write_results_md(tmp_path / "R.md", runs_dir=runs, store=store).read_text()
    section = md.split("## Asynchronous RL", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split("|")[1:3] for line in lines] == [
        [" synchronous ", " off "], [" synchronous ", " icepop "], [" async L=1 ", " off "], [" async L=1 ", " icepop "],
        [" async L=4 ", " off "], [" async L=4 ", " icepop "]]
    assert lines[-1].split("|")[9].strip() == "1 of 2"
