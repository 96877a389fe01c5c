"""Bad input ends with one line naming the file, field or line; `validate` refuses what a stage would."""

import pytest
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.data.io import read_jsonl
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import load_recipe

BASE = "run: {name: t}\nmodel: {tiny: {}}\n"


def _validate(tmp_path, text: str | bytes):
    path = tmp_path / "r.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return CliRunner().invoke(app, ["validate", str(path)])


def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(BASE.encode() + b"# caf\xe9\n")
    bad_at = len(BASE.encode()) + len("# caf")
    with pytest.raises(RecipeError, match=rf"r\.yaml: not valid UTF-8 \(byte {bad_at}\)"):
        load_recipe(path)


@pytest.mark.parametrize(("section", "field_and_why"), [
    ("rl: {steps: true}", "rl.steps: Value error, expected a number, not true/false"),
    ("run: {name: t, seed: false}", "run.seed: Value error, expected a number, not true/false"),
    ("trainer: {adam_betas: [0.9, 1.0]}", "trainer.adam_betas.1: Input should be less than 1"),
    ("trainer: {adam_betas: [-0.1, 0.9]}", "trainer.adam_betas.0: Input should be greater than or equal to 0"),
    ("eval: {pass_k: [1, 0]}", "eval.pass_k.1: Input should be greater than or equal to 1"),
])
def test_validate_refuses_what_a_stage_would(tmp_path, section, field_and_why):
    text = BASE.replace("run: {name: t}\n", "") + section + "\n" if section.startswith("run") else BASE + section + "\n"
    result = _validate(tmp_path, text)
    assert result.exit_code == 2 and field_and_why in " ".join(result.output.split())


def test_numbers_still_read_as_numbers(tmp_path):
    assert _validate(tmp_path, BASE + "rl: {steps: 3}\ntrainer: {lr: 1, adam_betas: [0, 0.999]}\n").exit_code == 0


@pytest.mark.parametrize(("kind", "row"), [
    ("rl", '{"id": 1, "prompt": "p", "answers": [NaN]}'),
    ("eval", '{"id": 1, "problem": "p", "answer": Infinity}'),
])
def test_nan_answers_are_refused_with_their_line(tmp_path, kind, row):
    path = tmp_path / "d.jsonl"
    good = {"rl": '{"id": 0, "prompt": "p", "answers": ["3"]}', "eval": '{"id": 0, "problem": "p", "answer": 3}'}
    path.write_text(good[kind] + "\n" + row + "\n")
    with pytest.raises(UserError, match=r"d\.jsonl:2: field 'answers?' (contains an empty|is empty)"):
        read_jsonl(path, kind)


def test_grade_refuses_a_nan_timeout_and_an_empty_file(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text('{"response": "\\\\boxed{3}", "answer": "3"}\n')
    result = CliRunner().invoke(app, ["grade", str(src), "--timeout", "nan"])
    assert isinstance(result.exception, UserError) and "--timeout must be a positive number" in str(result.exception)
    src.write_text("\n")
    result = CliRunner().invoke(app, ["grade", str(src)])
    assert isinstance(result.exception, UserError) and str(result.exception) == f"{src}: no rows to grade"
    assert not (tmp_path / "g.graded.jsonl").exists()


@pytest.mark.parametrize("args", [["--forget-prob", "5"], ["--forget-prob", "-0.1"], ["--n-rl", "0"]])
def test_data_make_refuses_out_of_range_options(tmp_path, args):
    out = tmp_path / "d"
    result = CliRunner().invoke(app, ["data", "make", "tiny-arith", "--out", str(out), *args])
    assert result.exit_code == 2 and args[0] in result.output and not out.exists()
