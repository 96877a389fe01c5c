"""RESULTS.md and `rlrecipe results` from summary.json files written into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlrecipe.eval.report import (
    all_results,
    collect_results,
    published_references,
    render_results_md,
    write_results_md,
)
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from tests.conftest import REPO

ROOT = Path(__file__).resolve().parents[2]
SHA_A = "a" * 12 + "0" * 52
SHA_B = "b" * 12 + "1" * 52


def _summary(runs: Path, run: str, benchmark: str, **over) -> Path:
    record = {
        "run": run, "recipe": "recipes/7b_boba.yaml", "recipe_sha256": SHA_A,
        "model": "runs/boba/final", "benchmark": benchmark, "avg": 0.6, "stderr": 0.012,
        "n": 32, "num_problems": 30, "pass_at_k": {"1": 0.6, "8": 0.75, "32": 0.8},
        "greedy_acc": None, "commit": "0123456789abcdef0123456789abcdef01234567",
        "date": "2025-06-01T12:00:00+00:00", "temperature": 0.6, "top_p": 0.95,
        "max_new_tokens": 27648, "wall_time_s": 3600.4, "tokens_generated": 12345678,
        "reference": {"avg": 61.9} if benchmark == "aime24" else None,
        "per_problem": {"1": 0.5},
    }
    record.update(over)
    path = runs / run / "eval" / benchmark / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    _summary(runs, "boba-old", "aime24", avg=0.5, date="2025-05-01T00:00:00+00:00", recipe_sha256=SHA_B)
    _summary(runs, "boba", "aime24")
    _summary(runs, "boba", "aime25", avg=0.475, stderr=0.02,
             pass_at_k={"1": 0.475, "32": 0.7}, commit="fedcba9876543210", dirty=True)
    _summary(runs, "tiny", "tiny_arith", recipe="recipes/tiny.yaml", model="tiny-qwen2",
             avg=1.0, stderr=0.0, n=4, num_problems=1, pass_at_k={"1": 1.0, "4": 1.0}, greedy_acc=0.75,
             recipe_sha256=SHA_B, date="2025-06-02T08:30:00")
    (runs / "no-eval").mkdir()
    return runs


def test_collect_keeps_newest_per_key(runs):
    results = collect_results(runs)
    keys = [(r["recipe"], r["model"], r["benchmark"]) for r in results]
    assert keys == [("recipes/7b_boba.yaml", "runs/boba/final", "aime24"),
                    ("recipes/7b_boba.yaml", "runs/boba/final", "aime25"),
                    ("recipes/tiny.yaml", "tiny-qwen2", "tiny_arith")]
    assert results[0]["run"] == "boba" and results[0]["avg"] == 0.6  # not the older 0.5
    assert results[0]["pass_at_k"] == {1: 0.6, 8: 0.75, 32: 0.8}
    assert collect_results(runs.parent / "nowhere") == []


def _rows(md: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in md.splitlines()
            if ln.startswith("| " + first_cell)]


def test_render_rows(runs):
    md = render_results_md(collect_results(runs))
    header = next(ln for ln in md.splitlines() if ln.startswith("| Recipe |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:6] == ["Recipe", "Model", "Benchmark", "avg@n ± se", "n", "problems"]
    assert [c for c in cols if c.startswith("pass@")] == ["pass@1", "pass@4", "pass@8", "pass@32"]
    rows = [dict(zip(cols, r, strict=True)) for r in _rows(md, "recipes/")]
    assert len(rows) == 3
    a24, a25, tiny = rows
    assert a24["avg@n ± se"] == "60.0 ± 1.2"
    assert (a24["pass@1"], a24["pass@8"], a24["pass@32"], a24["pass@4"]) == ("60.0", "75.0", "80.0", "-")
    assert a24["published"] == "61.9" and a24["Δ"] == "-1.9"
    assert a24["recipe sha256"] == "a" * 12 and a24["commit"] == "0123456" and a24["date"] == "2025-06-01"
    assert a25["avg@n ± se"] == "47.5 ± 2.0" and a25["published"] == "-" and a25["commit"] == "fedcba9+dirty"
    assert tiny["greedy"] == "75.0" and tiny["n"] == "4" and tiny["recipe sha256"] == "b" * 12
    assert "12,345,678" in md  # the sampling and cost table
    assert "Published reference numbers" not in md  # none given


def test_the_grader_of_each_result_is_shown(runs):
    _summary(runs, "tiny", "tiny_arith", recipe="recipes/tiny.yaml", model="tiny-qwen2", grader="math-verify 0.9.0",
             date="2025-06-03T00:00:00")
    md = render_results_md(collect_results(runs))
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| Run |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[start:end]]
    cols, body = table[0], table[2:]
    rows = {(r["Run"], r["Benchmark"]): r["grader"] for r in (dict(zip(cols, row, strict=True)) for row in body)}
    # one result names its grader; the others were recorded before results named one
    assert rows == {("boba", "aime24"): "-", ("boba", "aime25"): "-", ("tiny", "tiny_arith"): "math-verify 0.9.0"}


def test_published_numbers_come_from_the_shipped_recipes(monkeypatch):
    monkeypatch.chdir(REPO)
    published = published_references()
    by_recipe = {p["recipe"]: p for p in published}
    assert by_recipe["recipes/7b_boba.yaml"]["references"] == {"aime24": 61.9, "aime25": 48.3}
    assert by_recipe["recipes/32b_200.yaml"]["references"] == {"aime24": 78.8, "aime25": 62.1}
    assert by_recipe["recipes/r1_distill_7b_eval.yaml"]["references"] == {"aime24": 55.0, "aime25": 39.7}
    assert "recipes/tiny_rl.yaml" not in by_recipe  # declares no reference
    md = render_results_md([], published)
    section = md[md.index("## Published reference numbers"):]
    assert "| Recipe | Model | aime24 | aime25 |" in section
    row = _rows(section, "recipes/32b_200.yaml")[0]
    assert row[2:] == ["78.8", "62.1"] and "32B" in row[1]


def test_across_seeds_mean_and_spread(tmp_path):
    runs, exp = tmp_path / "runs", "e" * 64
    for run, seed, avg, date in [("s1-old", 1, 0.10, "2025-05-01T00:00:00+00:00"),  # superseded by s1
                                 ("s1", 1, 0.80, "2025-06-01T00:00:00+00:00"), ("s2", 2, 0.90, "2025-06-02T00:00:00+00:00"),
                                 ("s3", 3, 0.85, "2025-06-03T00:00:00+00:00")]:
        _summary(runs, run, "tiny", recipe="recipes/tiny_rl.yaml", model=f"runs/{run}/final", avg=avg, seed=seed,
                 experiment_sha256=exp, date=date)
    _summary(runs, "alone", "tiny", model="runs/alone/final", seed=1, experiment_sha256="f" * 64)  # one seed only
    md = render_results_md(collect_results(runs))
    # 80, 90, 85: mean 85, sample sd sqrt((25 + 25 + 0) / 2) = 5
    assert "| recipes/tiny_rl.yaml | tiny | 1 2 3 | 85.0 | 5.0 | 80.0 | 90.0 | eeeeeeeeeeee |" in md
    assert "ffffffffffff" not in md


def test_render_empty():
    md = render_results_md([])
    assert "No results are recorded yet" in md and "| Recipe | Model |" not in md


def test_bad_summary_names_the_file(tmp_path):
    runs = tmp_path / "runs"
    path = _summary(runs, "r", "aime24")
    path.write_text("{\n  broken")
    with pytest.raises(UserError, match=f"{path}:2"):
        collect_results(runs)
    path.write_text(json.dumps({"recipe": "x", "model": "m", "benchmark": "b"}))
    with pytest.raises(UserError, match="'avg'"):
        collect_results(runs)
    path.write_text(json.dumps({"recipe": "x", "model": "m", "benchmark": "b", "avg": 0.1,
                                "pass_at_k": {"one": 0.1}}))
    with pytest.raises(UserError, match="pass_at_k"):
        collect_results(runs)


def test_results_command_json_and_write(runs, tmp_path, monkeypatch):
    from rlrecipe.cli.app import app

    monkeypatch.chdir(tmp_path)  # `runs/` and RESULTS.md relative to the working directory
    result = CliRunner().invoke(app, ["results", "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [(r["benchmark"], r["avg"]) for r in records] == [("aime24", 0.6), ("aime25", 0.475), ("tiny_arith", 1.0)]
    for key in ("recipe", "recipe_sha256", "model", "benchmark", "avg", "stderr", "n", "pass_at_k", "commit"):
        assert key in records[0]
    assert records[0]["pass_at_k"] == {"1": 0.6, "8": 0.75, "32": 0.8}
    assert records[0]["recipe_sha256"] == SHA_A and "per_problem" not in records[0]
    md = (tmp_path / "RESULTS.md").read_text()
    assert md == render_results_md(all_results("runs"))
    assert " *" in md and "not yet kept in `results/`" in md  # local runs, none kept in this store


def test_cli_results(runs, tmp_path, monkeypatch):
    from rlrecipe.cli.app import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["results", "--json", "--no-write"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "RESULTS.md").exists()
    start = result.output.index("[")
    assert len(json.loads(result.output[start:])) == 3
    result = CliRunner().invoke(app, ["results"])
    assert result.exit_code == 0, result.output
    assert "aime25" in result.output and "tiny_arith" in result.output and "@32 80.0" in result.output
    assert (tmp_path / "RESULTS.md").exists()


def test_write_results_md_empty(tmp_path):
    out = write_results_md(tmp_path / "RESULTS.md", runs_dir=tmp_path / "runs", store=tmp_path / "results")
    assert "No results are recorded yet" in out.read_text()


def test_committed_results_md_is_what_the_kept_results_give_on_a_fresh_clone(tmp_path, monkeypatch):
    # a fresh clone has no runs/: RESULTS.md regenerated there must equal the committed file
    monkeypatch.chdir(ROOT)
    out = write_results_md(tmp_path / "RESULTS.md", runs_dir=tmp_path / "no-runs")
    assert out.read_text() == (ROOT / "RESULTS.md").read_text()


def test_the_async_study_renders_its_time_axis_and_the_time_to_reach_sync_accuracy(tmp_path):
    from rlrecipe.eval.study_sections import async_section

    from scripts.async_study import time_table

    def row(lag, seed, avgs, s_per_step):
        curve = [{"step": 5 * (i + 1), "wall_s": 5 * (i + 1) * s_per_step, "drain_s": 0.0, "avg": a}
                 for i, a in enumerate(avgs)]
        return {"correction": "icepop", "level": lag, "seed": seed, "curve": curve}

    rows = [row(0, s, [0.6, 0.7, 0.8], 2.0) for s in (1, 2)] + [row(1, s, [0.7, 0.8, 0.8], 1.5) for s in (1, 2)]
    rows += [row(2, 1, [0.5, 0.6, 0.7], 1.0), row(2, 2, [0.5, 0.6, 0.9], 1.0)]
    table = {t["lag"]: t for t in time_table(rows)}
    assert table[0]["target_avg"] == 0.8 and table[0]["reach_wall_s"] == 30.0 and table[0]["s_per_step"] == 2.0
    assert table[1]["reach_wall_s"] == 15.0 and table[1]["reach_step"] == 10 and table[1]["seeds_reaching"] == 2
    # the seed mean of lag 2 ends at 0.8 (0.7 and 0.9): reached at its last point; one seed alone never does
    assert table[2]["reach_step"] == 15 and table[2]["reach_wall_s_seeds"] == [None, 15.0]
    study = {"plan": {"eval_every": 5, "openmp_wait": {"GOMP_SPINCOUNT": "300000"}}, "table": [],
             "time_table": list(table.values()), "figure": "results/x.png"}
    md = async_section(study)
    assert "OpenMP wait, every arm: GOMP_SPINCOUNT=300000." in " ".join(md.split())
    assert "reach sync's final at" in md and "| async L=1 | icepop | 1 2 | 1.50 | 22 | 0 | 80.0 ± 0.0 | 80.0 | 15 s (step 10) |" in md
    never = async_section({**study, "time_table": [{**table[2], "reach_wall_s": None, "reach_step": None}]})
    assert "never within the run" in never
