"""What a newcomer meets first: messages that say what to do, output printed once, and text fields
that take what was typed."""

from __future__ import annotations

import logging
import warnings

import pytest
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.data.io import read_jsonl
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, load_recipe, recipe_from_dict
from rlrecipe.rollout.inprocess import InProcessEngine, cache_keyword
from rlrecipe.run.record import Run
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.conftest import REPO
from tests.helpers import write_recipe

TINY_RL = str(REPO / "recipes" / "tiny_rl.yaml")


@pytest.mark.parametrize(("typo", "meant"), [("rl.icepop.alpah", "alpha"), ("trainer.lr_schedul", "lr_schedule"),
                                             ("rl.c3po.token_budgt", "token_budget")])
def test_an_unknown_key_names_the_closest_field(typo, meant):
    with pytest.raises(RecipeError, match=f"{typo.replace('.', '[.]')}: unknown key; did you mean '{meant}'"):
        load_recipe(TINY_RL, [f"{typo}=1"])


def test_an_unknown_key_in_a_list_item_names_the_closest_field():
    with pytest.raises(RecipeError, match=r"eval\.benchmarks\.0\.pth: unknown key; did you mean 'path'"):
        recipe_from_dict({"run": {"name": "r"}, "model": {"tiny": {}},
                          "eval": {"benchmarks": [{"name": "b", "pth": "x"}]}}, "r.yaml")


def test_an_unknown_key_far_from_any_field_gets_no_guess():
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY_RL, ["trainer.zzzzzz=1"])
    assert str(err.value).endswith("trainer.zzzzzz: unknown key")


@pytest.mark.parametrize(("override", "field", "value"), [
    ("rl.icepop.mode=off", ("rl", "icepop", "mode"), "off"),
    ("run.name=2024", ("run", "name"), "2024"),
    ("run.name=off", ("run", "name"), "off"),
    ("rollout.engine=sglang", ("rollout", "engine"), "sglang"),
])
def test_text_fields_take_the_text_as_typed(override, field, value):
    recipe = load_recipe(TINY_RL, [override]).recipe
    node = recipe
    for part in field:
        node = getattr(node, part)
    assert node == value


def test_numbers_still_refuse_yaml_words():
    with pytest.raises(RecipeError, match="rl.steps"):
        load_recipe(TINY_RL, ["rl.steps=off"])


def test_icepop_mode_off_written_bare_in_a_recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("run: {name: r}\nmodel: {tiny: {}}\nrl:\n  icepop:\n    mode: off\n")
    assert load_recipe(path).recipe.rl.icepop.mode == "off"


def test_missing_data_says_how_to_make_it(tmp_path):
    with pytest.raises(UserError, match=r"file not found; make it with `rlrecipe data make tiny-arith --out "):
        read_jsonl(tmp_path / "tiny-arith" / "rl.jsonl", "rl")
    with pytest.raises(UserError, match=r"file not found; fetch it with `rlrecipe data download aime24`"):
        read_jsonl(tmp_path / "aime24" / "eval.jsonl", "eval")
    with pytest.raises(UserError) as err:
        read_jsonl(tmp_path / "mine" / "rl.jsonl", "rl")
    assert str(err.value).endswith("file not found")


def test_validate_prints_the_whole_sha256(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", {"run": {"name": "ok"}, "model": {"tiny": {}}})
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0
    assert load_recipe(path).sha256 in result.output and len(load_recipe(path).sha256) == 64


def test_echoed_steps_show_the_total_and_the_time_left(tmp_path, capsys):
    recipe = recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "model": {"tiny": {}}})
    run = Run(LoadedRecipe(recipe=recipe, path="r.yaml"), "rl")
    for step in (1, 2):
        run.log(step, {"loss": 1.0}, total=4)
    run.log(3, {"loss": 1.0})
    run.finish()
    lines = [" ".join(line.split()) for line in capsys.readouterr().err.splitlines() if "step" in line]
    assert lines[0].startswith("rl step 1/4 (") and "s/step, eta " in lines[0]
    assert lines[1].startswith("rl step 2/4 (") and lines[2].startswith("rl step 3: loss=1")


def test_deepspeed_cpu_fallback_notice_is_dropped_and_nothing_else(caplog):
    import rlrecipe  # noqa: F401 - installs the filter

    logger = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("something else DeepSpeed says")
    assert [r.getMessage() for r in caplog.records if r.name == "DeepSpeed"] == ["something else DeepSpeed says"]


def test_the_rollout_engine_raises_no_deprecation_warning(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = InProcessEngine(tiny_model_dir, tok.eos_token_id, tok.pad_token_id, max_batch=4)
    trajs = [Trajectory(uid=str(i), prompt_ids=tok.encode(f"Add {i} and {i * 7}.")) for i in range(3)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.generate(trajs, SamplingParams(max_new_tokens=6), seed=1)
    assert not [w for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))
                and "past_key_values" in str(w.message)]
    assert cache_keyword(engine.model) in ("cache", "past_key_values")
