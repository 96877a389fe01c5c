"""model.revision: the hub snapshot is resolved once and recorded in env.json with its chat template."""

from __future__ import annotations

import hashlib
import json

import huggingface_hub.constants as hub_constants
import pytest

from rlrecipe.modeling import create_tiny, resolve_model_dir
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.recipe.training import TinyModel
from rlrecipe.run.record import Run
from rlrecipe.stages.lifecycle import starting_model
from tests.helpers import DATA, build_r1_tokenizer

COMMIT = "916b56a44061fd5cd7d6a8fb632557ed4f724f60"
OTHER = "1" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline hub cache holding org/r1 at COMMIT: a tiny model with an R1-shaped tokenizer."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--r1"
    snap = repo / "snapshots" / COMMIT
    create_tiny(TinyModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), snap, 1)
    build_r1_tokenizer(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return snap


def make_run(tmp_path, model: dict, name: str = "r") -> Run:
    recipe = recipe_from_dict({"run": {"name": name, "output_dir": str(tmp_path / "runs")}, "model": model})
    return Run(LoadedRecipe(recipe=recipe, path="r.yaml"), "rl")


def test_revision_resolves_to_the_snapshot_and_is_recorded(tmp_path, hub_cache):
    run = make_run(tmp_path, {"path": "org/r1", "revision": COMMIT})
    got = starting_model(run, None)
    assert got.resolve() == hub_cache.resolve()
    env = json.loads((run.dir / "env.json").read_text())
    template = (DATA / "r1_chat_template.jinja").read_text()
    assert env["model"]["revision_requested"] == env["model"]["revision_resolved"] == COMMIT
    assert env["model"]["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert env["model"]["generation_prompt_suffix"] == "<｜Assistant｜><think>\n"
    assert env["recipe_sha256"] == run.loaded.sha256  # the rest of env.json is kept


def test_unpinned_hub_id_records_the_commit_it_got(tmp_path, hub_cache):
    run = make_run(tmp_path, {"path": "org/r1"})
    starting_model(run, None)
    env = json.loads((run.dir / "env.json").read_text())
    assert env["model"]["revision_requested"] is None and env["model"]["revision_resolved"] == COMMIT


def test_a_revision_that_cannot_be_had_is_one_clear_error(tmp_path, hub_cache):
    run = make_run(tmp_path, {"path": "org/r1", "revision": OTHER})
    with pytest.raises(RecipeError, match=f"model.path org/r1 at revision {OTHER}: cannot get it"):
        resolve_model_dir(run.recipe.model, None, run.dir, 1)


def test_a_local_directory_must_be_the_pinned_snapshot(tmp_path, hub_cache):
    ok = make_run(tmp_path, {"path": str(hub_cache), "revision": COMMIT})
    assert resolve_model_dir(ok.recipe.model, None, ok.dir, 1) == hub_cache
    bad = make_run(tmp_path, {"path": str(hub_cache), "revision": OTHER}, name="other")
    with pytest.raises(RecipeError, match="is a local directory, so model.revision .* cannot be checked"):
        resolve_model_dir(bad.recipe.model, None, bad.dir, 1)


def test_tiny_model_record_has_no_revision(tmp_path):
    run = make_run(tmp_path, {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2,
                                       "intermediate_size": 64}})
    starting_model(run, None)
    model = json.loads((run.dir / "env.json").read_text())["model"]
    assert model["revision_resolved"] is None and model["generation_prompt_suffix"] == "<|assistant|>"


@pytest.mark.parametrize("model, message", [
    ({"path": "org/r1", "revision": "main"}, "model.revision: Value error, must be a full commit sha"),
    ({"path": "org/r1", "revision": COMMIT[:12]}, "model.revision: Value error, must be a full commit sha"),
    ({"tiny": {}, "revision": COMMIT}, "model: Value error, revision pins a hub snapshot of model.path"),
])
def test_revision_schema(model, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"run": {"name": "r"}, "model": model}, "r.yaml")


def test_raw_training_template_needs_an_eval_template():
    with pytest.raises(RecipeError, match="data: Value error, eval_template: evaluation problems carry no chat"):
        recipe_from_dict({"run": {"name": "r"}, "model": {"tiny": {}}, "data": {"prompt_template": "raw"}})
    data = recipe_from_dict({"run": {"name": "r"}, "model": {"tiny": {}},
                             "data": {"prompt_template": "raw", "eval_template": "areal_boba"}}).data
    assert data.eval_prompt_template == "areal_boba"


def test_eval_of_a_hub_model_reads_the_pinned_revision(tmp_path, hub_cache):
    from rlrecipe.stages.evaluate import model_to_evaluate

    recipe = recipe_from_dict({"run": {"name": "base", "output_dir": str(tmp_path / "runs")},
                               "model": {"path": "org/r1", "revision": COMMIT}})
    loaded = LoadedRecipe(recipe=recipe, path="r.yaml")
    run = Run(loaded, "eval", subdir="eval")
    assert model_to_evaluate(loaded, run, None).resolve() == hub_cache.resolve()
    env = json.loads((run.dir / "env.json").read_text())
    assert env["model"]["revision_resolved"] == COMMIT and env["stage"] == "eval"
    # --model naming the recipe's hub id keeps its pin; another revision cannot be had offline
    assert model_to_evaluate(loaded, run, "org/r1").resolve() == hub_cache.resolve()
    run.release()
    other = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "other", "output_dir": str(tmp_path / "runs")},
                                                  "model": {"path": "org/r1", "revision": OTHER}}), path="o.yaml")
    with pytest.raises(RecipeError, match=f"revision {OTHER}"):
        model_to_evaluate(other, Run(other, "eval", subdir="eval"), None)
    # a run's own final export comes first
    final = run.final_model_dir
    create_tiny(TinyModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64), final, 1)
    assert model_to_evaluate(loaded, run, None) == final
