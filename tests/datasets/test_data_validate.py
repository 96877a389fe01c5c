"""`rlrecipe data validate` and the strict canonical reader (io.read_jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.data.io import load_rows, read_jsonl, resolve_dataset_path, write_jsonl_atomic
from rlrecipe.data.validate import validate_file

RLRECIPE = Path(sys.executable).parent / "rlrecipe"


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def rl(id_, prompt="P", answers=("1",)):
    return json.dumps({"id": id_, "prompt": prompt, "answers": list(answers)})


@pytest.mark.parametrize("kind, bad_line, message", [
    ("rl", '{"id": "x", "prompt": "P", "answers": [', r":3: malformed JSON"),
    ("rl", '{"id": "x", "prompt": "P"}', r":3: missing field\(s\) answers for a rl row"),
    ("rl", '{"id": "x", "prompt": "P", "answers": []}', r":3: field 'answers' is empty"),
    ("rl", '{"id": "x", "prompt": "P", "answers": "1"}', r":3: field 'answers' must be a list"),
    ("rl", '{"id": "x", "prompt": "P", "answers": ["", "2"]}', r":3: field 'answers' contains an empty"),
    ("rl", '{"id": "x", "prompt": "  ", "answers": ["2"]}', r":3: field 'prompt' is empty"),
    ("rl", '["id", "prompt"]', r":3: expected a JSON object"),
    ("sft", '{"id": "x", "prompt": "P", "response": ""}', r":3: field 'response' is empty"),
    ("eval", '{"id": null, "problem": "P", "answer": "1"}', r":3: field 'id' must be"),
    ("eval", '{"id": "x", "problem": "P", "answer": ""}', r":3: field 'answer' is empty"),
])
def test_errors_name_file_and_line(tmp_path, kind, bad_line, message):
    good = {"rl": rl("a"), "sft": json.dumps({"id": "a", "prompt": "P", "response": "R"}),
            "eval": json.dumps({"id": "a", "problem": "P", "answer": "1"})}[kind]
    path = write_lines(tmp_path / "d.jsonl", good, "", bad_line, good)
    with pytest.raises(UserError, match=message) as err:
        validate_file(path, kind)
    assert str(err.value).startswith(f"{path}:3: ")
    assert "\n" not in str(err.value)


def test_valid_file_counts_repeated_prompts_and_refuses_repeated_ids(tmp_path):
    path = write_lines(tmp_path / "rl.jsonl", rl("a", "P1"), rl("b", "P2", ["1", "2", "3"]), rl("e", "P3"),
                       rl("c", "P1"), rl("d", " P1 "))
    report = validate_file(path, "rl")
    assert (report.rows, report.duplicate_prompts) == (5, 2)
    lines = report.summary_lines()
    assert "rows:               5" in lines and "duplicate prompts:  2" in lines
    twice = write_lines(tmp_path / "twice.jsonl", rl("a", "P1"), rl("b", "P2"), rl("a", "P3"))
    with pytest.raises(UserError, match=r"twice.jsonl:3: id 'a' is already the id of line 1"):
        validate_file(twice, "rl")
    assert any(line.startswith("answers per prompt:") and "(max 3)" in line for line in lines)


def test_empty_file_is_an_error(tmp_path):
    path = write_lines(tmp_path / "e.jsonl", "")
    with pytest.raises(UserError, match="no rows"):
        validate_file(path, "eval")


def test_reader_normalises_numeric_answers(tmp_path):
    ev = write_lines(tmp_path / "e.jsonl", '{"id": 7, "problem": "P", "answer": 204}')
    assert read_jsonl(ev, "eval") == [{"id": 7, "problem": "P", "answer": "204"}]
    r = write_lines(tmp_path / "r.jsonl", '{"id": "r", "prompt": "P", "answers": [3, "4"], "extra": 1}')
    assert read_jsonl(r, "rl") == [{"id": "r", "prompt": "P", "answers": ["3", "4"], "extra": 1}]
    with pytest.raises(UserError, match=":1: missing field"):
        read_jsonl(ev, "rl")


def test_write_atomic_and_resolve(tmp_path, monkeypatch):
    out = tmp_path / "ds" / "rl.jsonl"
    assert write_jsonl_atomic(out, [{"id": "a", "prompt": "P", "answers": ["1"]}]) == 1
    assert [p.name for p in out.parent.iterdir()] == ["rl.jsonl"]

    def explode():
        yield {"id": "b", "prompt": "P", "answers": ["1"]}
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_jsonl_atomic(out, explode())
    assert [p.name for p in out.parent.iterdir()] == ["rl.jsonl"]
    assert load_rows(str(out), "rl")[0]["id"] == "a"
    assert resolve_dataset_path(str(out.parent), "rl") == out  # a directory resolves to its KIND.jsonl


def run_validate(*args):
    return subprocess.run([str(RLRECIPE), "data", "validate", *args], capture_output=True, text=True, timeout=60)


def test_cli_validate(tmp_path):
    good = write_lines(tmp_path / "ok.jsonl", rl("a"), rl("b"))
    proc = run_validate(str(good), "--kind", "rl")
    assert proc.returncode == 0, proc.stderr
    assert "rows:               2" in proc.stdout and "duplicate prompts:  1" in proc.stdout

    bad = write_lines(tmp_path / "bad.jsonl", rl("a"), '{"id": "b", "prompt": "P", "answers": []}')
    proc = run_validate(str(bad), "--kind", "rl")
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [f"error: {bad}:2: field 'answers' is empty"]

    proc = run_validate(str(tmp_path / "missing.jsonl"), "--kind", "sft")
    assert proc.returncode == 2 and "file not found" in proc.stdout + proc.stderr
