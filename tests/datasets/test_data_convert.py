"""Conversion of raw rows (AReaL RL/SFT, eval sets) into canonical rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.data.convert import convert_file, convert_records, read_raw, strip_boxed, strip_template
from rlrecipe.data.io import check_row
from rlrecipe.data.templates import R1_INSTRUCTION

BOS, USER, ASSISTANT, EOS = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def r1_prompt(question: str) -> str:
    return f"{BOS}{USER}{question}\n{INSTRUCTION}{ASSISTANT}<think>\n"


def records(*rows):
    return [(f"line {i}", row) for i, row in enumerate(rows, 1)]


@pytest.mark.parametrize("raw, expected", [
    (r1_prompt("What is $1+1$?"), "What is $1+1$?"),
    (f"{BOS}You are helpful.{USER}Solve $x^2=4$ for $x>0$. {INSTRUCTION}{ASSISTANT}", "Solve $x^2=4$ for $x>0$."),
    ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many primes below 10?<|im_end|>\n"
     "<|im_start|>assistant\n", "How many primes below 10?"),
    (f"{INSTRUCTION}\nFind $n$.", "Find $n$."),
    ("Find $n$. Let's think step by step and output the final answer within \\boxed{}.", "Find $n$."),
    ("Plain problem with \\boxed{} mention kept.", "Plain problem with \\boxed{} mention kept."),
])
def test_strip_template(raw, expected):
    text, _ = strip_template(raw)
    assert text == expected


def test_stripped_prompt_is_bare_user_text():
    # The R1 template re-adds exactly this instruction at load time (templates.py).
    assert INSTRUCTION == R1_INSTRUCTION
    text, changes = strip_template(r1_prompt("What is $2+2$?"))
    assert changes == ["chat template stripped", "instruction stripped"]
    assert text == "What is $2+2$?"


@pytest.mark.parametrize("raw, expected", [
    ("\\boxed{42}", "42"),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    (" \\boxed{ 3\\sqrt{2} } ", "3\\sqrt{2}"),
    ("\\boxed{1} and \\boxed{2}", "\\boxed{1} and \\boxed{2}"),
    ("x = \\boxed{2}", "x = \\boxed{2}"),
    ("17", "17"),
    ("\\boxed{}", "\\boxed{}"),
])
def test_strip_boxed(raw, expected):
    assert strip_boxed(raw) == expected


def test_areal_rl_rows():
    result = convert_records(records(
        {"prompt": r1_prompt("Q1"), "task": "math", "query_id": "a1", "solutions": ["\\boxed{5}", "5", "\\boxed{10/2}"]},
        {"prompt": r1_prompt("Q2"), "task": "code", "query_id": "a2", "solutions": ["print(1)"]},
        {"prompt": r1_prompt("Q3"), "task": "math", "query_id": "a3", "solutions": []},
        {"prompt": r1_prompt("Q4"), "task": "math", "query_id": "a4", "solutions": ["", None]},
        {"prompt": f"{BOS}{USER}{INSTRUCTION}{ASSISTANT}", "query_id": "a5", "solutions": ["1"]},
        {"prompt": "Q6 already clean", "query_id": "a6", "solutions": [7]},
        {"query_id": "a7", "solutions": ["1"]},
        ["not", "an", "object"],
    ), "rl", name="boba", source="raw.jsonl")
    assert result.rows == [
        {"id": "a1", "prompt": "Q1", "answers": ["5", "10/2"], "raw_prompt": r1_prompt("Q1")},
        {"id": "a6", "prompt": "Q6 already clean", "answers": ["7"]},
    ]
    report = result.report
    assert (report.total, report.kept, report.converted, report.rejected) == (8, 2, 2, 6)
    assert report.reasons["task 'code' is not math"] == 1
    assert report.reasons["empty reference answers"] == 2
    assert report.reasons["field 'prompt' is empty"] == 1
    assert report.reasons["no prompt field"] == 1
    assert report.changes["chat template stripped"] == 1 and report.changes["\\boxed{} removed"] == 1
    assert report.examples[0] == "line 2: task 'code' is not math"
    lines = report.summary_lines()
    assert lines[1].startswith("kept:      2") and lines[3].startswith("rejected:  6")
    for row in result.rows:
        assert check_row(row, "rl")[1] is None


def test_areal_sft_rows_strip_template_and_eos():
    result = convert_records(records(
        {"prompt": r1_prompt("Add 2 and 2."), "answer": "2+2=4.\n</think>\n\nThe answer is \\boxed{4}." + EOS},
        {"prompt": "Say hi.", "response": "hi"},
        {"prompt": "No response"},
        {"prompt": "Empty", "answer": "   "},
    ), "sft", name="boba-200", source="sft.jsonl")
    assert result.rows == [
        {"id": "boba-200-1", "prompt": "Add 2 and 2.", "response": "2+2=4.\n</think>\n\nThe answer is \\boxed{4}.",
         # the source's text stays beside the clean one, byte for byte, for the raw template
         "raw_prompt": r1_prompt("Add 2 and 2."),
         "raw_response": "2+2=4.\n</think>\n\nThe answer is \\boxed{4}." + EOS},
        {"id": "boba-200-2", "prompt": "Say hi.", "response": "hi"},
    ]
    assert result.report.rejected == 2
    assert result.report.changes["eos token stripped"] == 1


def test_eval_rows_answers_become_strings_and_ids_unique():
    result = convert_records(records(
        {"id": 1, "problem": "P1", "answer": 204, "solution": "long text \\boxed{204}"},
        {"id": 1, "problem": "P2", "answer": "\\boxed{025}"},
        {"ID": "2024-II-4", "Problem": "P3", "Answer": 33.0},
        {"problem": "P4", "answer": ["1", "2"]},
        {"question": "P5", "answer": None},
    ), "eval", name="aime", source="aime.jsonl")
    assert result.rows == [
        {"id": "1", "problem": "P1", "answer": "204"},
        {"id": "1#2", "problem": "P2", "answer": "025"},
        {"id": "2024-II-4", "problem": "P3", "answer": "33"},
    ]
    assert result.report.changes["duplicate id renamed"] == 1
    assert result.report.rejected == 2


def test_read_raw_formats(tmp_path):
    rows = [{"problem": "P1", "answer": 1}, {"problem": "P2", "answer": 2}]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n{broken\n")
    as_list = tmp_path / "b.json"
    as_list.write_text(json.dumps(rows, indent=2))
    wrapped = tmp_path / "c.json"
    wrapped.write_text(json.dumps({"version": 1, "data": rows}, indent=2))
    jsonl_named_json = tmp_path / "d.json"
    jsonl_named_json.write_text("\n".join(json.dumps(r) for r in rows))
    parquet = tmp_path / "e.data"  # content, not the extension, decides
    pq.write_table(pa.Table.from_pylist(rows), parquet)

    got = list(read_raw(jsonl))
    assert [w for w, _ in got] == ["line 1", "line 2", "line 4"]
    assert got[2][1].reason.startswith("malformed JSON")
    for path, where in ((as_list, "item"), (wrapped, "item"), (jsonl_named_json, "line"), (parquet, "row")):
        got = list(read_raw(path))
        assert [r for _, r in got] == rows, path
        assert got[0][0] == f"{where} 1"

    result = convert_file(parquet, "eval", name="t")
    assert [r["answer"] for r in result.rows] == ["1", "2"]


def test_read_raw_unreadable_files_are_user_errors(tmp_path):
    bad_json = tmp_path / "x.json"
    bad_json.write_text('[{"problem": "p",\n')
    with pytest.raises(UserError, match=r"x.json:2: malformed JSON"):
        list(read_raw(bad_json))
    bad_parquet = tmp_path / "y.parquet"
    bad_parquet.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="y.parquet: cannot read as Parquet"):
        list(read_raw(bad_parquet))
    with pytest.raises(UserError, match="file not found"):
        list(read_raw(tmp_path / "missing.jsonl"))
