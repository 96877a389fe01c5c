"""`rlrecipe grade FILE`: rows in, graded rows and a summary out; bad rows named by file:line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.reward.grade_file import grade_file

ROOT = Path(__file__).resolve().parents[2]


def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_cli_grade(tmp_path):
    src = tmp_path / "samples.jsonl"
    _write_jsonl(src, [
        {"id": "a", "response": r"so \boxed{070}", "answer": "70"},
        {"id": "b", "response": r"\boxed{\frac{1}{2}}", "answers": ["0.5", "1/2"]},
        {"id": "c", "response": "no box", "answer": "3"},
        {"id": "d", "response": r"\boxed{4}", "answer": "4", "truncated": True},
    ])
    result = CliRunner().invoke(app, ["grade", str(src)])
    assert result.exit_code == 0, result.output
    assert "accuracy" in result.output and "50.0%" in result.output
    graded = [json.loads(ln) for ln in (tmp_path / "samples.graded.jsonl").read_text().splitlines()]
    assert [r["id"] for r in graded] == ["a", "b", "c", "d"]
    assert [r["correct"] for r in graded] == [True, True, False, False]
    assert [r["reward"] for r in graded] == [5.0, 5.0, -5.0, -5.0]
    assert [r["extracted"] for r in graded] == ["070", r"\frac{1}{2}", None, "4"]

    out = tmp_path / "sub" / "custom.jsonl"
    result = CliRunner().invoke(app, ["grade", str(src), "--out", str(out), "--timeout", "1.5"])
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("rows, line, message", [
    ([{"response": "x", "answer": "1"}, "{not json"], 2, "malformed JSON"),
    ([{"answer": "1"}], 1, "'response'"),
    ([{"response": "x"}], 1, "'answer'"),
    ([{"response": "x", "answers": []}], 1, "'answers'"),
    ([{"response": "x", "answer": ["1"]}], 1, "'answer'"),
    (["", "[1, 2]"], 2, "JSON object"),
])
def test_grade_file_bad_rows(tmp_path, rows, line, message):
    src = tmp_path / "bad.jsonl"
    _write_jsonl(src, rows)
    with pytest.raises(UserError) as err:
        grade_file(src, (5.0, -5.0), None, 2.0)
    assert f"{src}:{line}" in str(err.value) and message in str(err.value)


def test_cli_grade_user_error_exit_code(tmp_path):
    src = tmp_path / "bad.jsonl"
    _write_jsonl(src, [{"response": r"\boxed{1}", "answer": "1"}, {"response": 3, "answer": "1"}])
    exe = Path(sys.executable).with_name("rlrecipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "rlrecipe.cli.app"]
    proc = subprocess.run([*cmd, "grade", str(src)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert f"{src}:2" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(UserError, match="file not found"):
        grade_file(tmp_path / "missing.jsonl", (5.0, -5.0))
