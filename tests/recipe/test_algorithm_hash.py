"""The algorithm sha256: what decides what is trained, not where it runs; printed, recorded, reported."""

from __future__ import annotations

import pytest
from rlrecipe.cli.app import app
from rlrecipe.eval.report import algorithm_sha256, public_record, result_rows
from typer.testing import CliRunner

from rlrecipe.recipe.schema import ALGORITHM_FIELDS, LAYOUT_FIELDS, Recipe, algorithm_fields, load_recipe
from tests.conftest import REPO
from tests.helpers import write_recipe

BOBA = REPO / "recipes" / "7b_boba.yaml"


def test_every_field_of_the_schema_is_on_exactly_one_side():
    for section, field in Recipe.model_fields.items():
        algo, layout = ALGORITHM_FIELDS[section], LAYOUT_FIELDS[section]
        names = set(field.annotation.model_fields)
        if "*" in algo or "*" in layout:
            assert algo | layout in ({"*"},), section  # a whole section is on one side, alone
            continue
        assert algo | layout == names, f"{section}: unclassified {names - algo - layout}, unknown {(algo | layout) - names}"
        assert not algo & layout, section
    assert set(ALGORITHM_FIELDS) == set(LAYOUT_FIELDS) == set(Recipe.model_fields)


@pytest.mark.parametrize("override", [
    "run.seed=9", "run.name=elsewhere", "trainer.nproc=2", "trainer.nodes=3", "trainer.zero_stage=2",
    "trainer.offload_optimizer=true", "trainer.max_tokens_per_microbatch=28672",  # hence grad accumulation
    "trainer.logprob_chunk_tokens=256", "trainer.gpu_memory_gib=40", "rollout.sglang.tp_size=2",
    "rollout.sglang.num_servers=32", "rollout.sglang.nodes=1", "rollout.sglang.mem_fraction_static=0.9",
    "model.gradient_checkpointing=false", "model.attn_implementation=sdpa", "rl.save_every=20",
    "eval.temperature=0.6",
])
def test_where_and_how_it_runs_leaves_the_algorithm_hash(override):
    base, other = load_recipe(BOBA), load_recipe(BOBA, [override])
    assert other.sha256 != base.sha256
    assert other.recipe.algorithm_sha256() == base.recipe.algorithm_sha256()


@pytest.mark.parametrize("override", [
    "model.dtype=bfloat16", "rollout.dtype=bfloat16", "trainer.lr=1e-5", "trainer.adam_eps=1e-8",
    "rl.prompts_per_step=256", "rl.samples_per_prompt=8", "rl.eps_clip_high=0.28", "rl.async_lag=1",
    "rl.icepop.mode=icepop", "rl.c3po.enabled=true", "rollout.temperature=0.7", "rollout.max_new_tokens=16384",
    "data.max_prompt_tokens=2048", "model.revision=" + "a" * 40, "rl.steps=200", "trainer.engine=torch",
    "rl.max_token_staleness=4", "rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_cache_dtype=fp8_e5m2",
])
def test_what_is_trained_changes_the_algorithm_hash(override):
    base, other = load_recipe(BOBA), load_recipe(BOBA, [override])
    assert other.recipe.algorithm_sha256() != base.recipe.algorithm_sha256()


def test_validate_prints_both_hashes(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", {"run": {"name": "ok"}, "model": {"tiny": {}}})
    result = CliRunner().invoke(app, ["validate", str(path)])
    loaded = load_recipe(path)
    assert result.exit_code == 0
    assert f"ok  {loaded.sha256}  algorithm {loaded.recipe.algorithm_sha256()}  {path}" in result.output


def test_results_rows_show_the_algorithm_hash(monkeypatch):
    monkeypatch.chdir(REPO)
    boba = load_recipe(BOBA)
    recorded = {"recipe": "recipes/7b_boba.yaml", "model": "m", "benchmark": "aime24", "avg": 0.5,
                "recipe_sha256": "f" * 64, "algorithm_sha256": "a" * 64}
    # recorded before runs wrote it: from the recipe file, while its sha256 (even cut to 12) is the recorded one
    older = {**recorded, "recipe_sha256": boba.sha256[:12]}
    older.pop("algorithm_sha256")
    changed = {**older, "recipe_sha256": "0" * 12}
    header, rows = result_rows([recorded, older, changed])
    col = header.index("algorithm sha256")
    assert [r[col] for r in rows] == ["a" * 12, boba.recipe.algorithm_sha256()[:12], "-"]
    assert algorithm_sha256({**older, "recipe": "recipes/nope.yaml"}) is None
    # `rlrecipe results --json` gives the same
    assert public_record(older)["algorithm_sha256"] == boba.recipe.algorithm_sha256()
    assert public_record(changed)["algorithm_sha256"] is None


def test_an_evaluation_summary_records_the_algorithm_hash(tmp_path, tiny_model_dir):
    from rlrecipe.eval.runner import evaluate_benchmarks

    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.recipe.schema import recipe_from_dict
    from rlrecipe.reward import Grader
    from rlrecipe.rollout.inprocess import InProcessEngine
    from tests.helpers import write_tiny_data

    data = write_tiny_data(tmp_path / "data", n=2)
    recipe = recipe_from_dict({"run": {"name": "ev", "output_dir": str(tmp_path / "runs")},
                               "model": {"path": str(tiny_model_dir)}, "data": {"prompt_template": "plain"},
                               "eval": {"benchmarks": [{"name": "tiny", "path": str(data / "eval.jsonl")}],
                                        "n_samples": 1, "max_new_tokens": 4, "pass_k": [1]}})
    tok = load_tokenizer(tiny_model_dir)
    engine = InProcessEngine(tiny_model_dir, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=4)
    with Grader(timeout=2.0) as grader:
        summary = evaluate_benchmarks(recipe, engine, tok, grader, out_dir=tmp_path / "eval", model="m",
                                      recipe_path="r.yaml", recipe_sha256=recipe.sha256())["tiny"]
    assert summary["algorithm_sha256"] == recipe.algorithm_sha256() != recipe.sha256()
    assert '"algorithm_sha256"' in (tmp_path / "eval" / "tiny" / "summary.json").read_text()


def test_sglang_flags_that_change_the_numerics_enter_the_algorithm_hash():
    """--kv-cache-dtype, --quantization, --dtype (not as rollout.dtype's placeholder) and
    --enable-fp32-lm-head change what is sampled; other launch flags, and the in-process engine's
    unused SGLang section, do not."""
    from rlrecipe.recipe.schema import sglang_numerics

    assert sglang_numerics(["--mem-fraction-static", "0.8", "--kv-cache-dtype", "fp8_e4m3", "--quantization=fp8",
                            "--enable-fp32-lm-head", "--tp-size", "2"]) == [
        "--kv-cache-dtype=fp8_e4m3", "--quantization=fp8", "--enable-fp32-lm-head"]
    base = load_recipe(REPO / "recipes" / "7b_boba_icepop_c3po.yaml")
    same = ["rollout.sglang.extra_args=[--enable-metrics]", "rollout.sglang.mem_fraction_static=0.7"]
    assert load_recipe(REPO / "recipes" / "7b_boba_icepop_c3po.yaml", same).recipe.algorithm_sha256() == \
        base.recipe.algorithm_sha256()
    for flag in ("[--kv-cache-dtype, fp8_e4m3]", "[--quantization, fp8]", "[--dtype, float16]"):
        other = load_recipe(REPO / "recipes" / "7b_boba_icepop_c3po.yaml", [f"rollout.sglang.extra_args={flag}"])
        assert other.recipe.algorithm_sha256() != base.recipe.algorithm_sha256(), flag
    sglang = load_recipe(REPO / "recipes" / "tiny_rl_sglang.yaml")  # its launch_cmd passes {dtype} only
    assert "sglang_numerics" not in algorithm_fields(sglang.recipe.hashed())["rollout"]
    tiny = load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rollout.sglang.extra_args=[--quantization, fp8]"])
    assert tiny.recipe.algorithm_sha256() == load_recipe(REPO / "recipes" / "tiny_rl.yaml").recipe.algorithm_sha256()


def test_two_layouts_with_one_algorithm_hash_train_alike(tmp_path, tiny_model_dir):
    """What docs/gpu.md promises of one algorithm sha256 across layouts, on CPU: bookkeeping
    (checkpoint cadence, names) leaves every number bit for bit; the micro-batch size (gradient
    accumulation) leaves the rollout exact and the update equal up to rounding. Early stop and
    C3PO++, which still read the layout, are off."""
    import json

    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.stages.rl import run_rl
    from tests.helpers import rl_recipe, write_tiny_data

    data = write_tiny_data(tmp_path / "data")
    layouts = {"a": {"save_every": 1, "mb": 512}, "b": {"save_every": 2, "mb": 512}, "c": {"save_every": 1, "mb": 96}}
    rows, hashes = {}, set()
    for name, lay in layouts.items():
        spec = rl_recipe(tmp_path / name, data, str(tiny_model_dir), steps=2, c3po={"enabled": False},
                         save_every=lay["save_every"])
        spec["run"]["name"] = f"rl-{name}"
        spec["trainer"]["max_tokens_per_microbatch"] = lay["mb"]
        spec["eval"] = {}
        recipe = recipe_from_dict(spec)
        hashes.add(recipe.algorithm_sha256())
        run_rl(LoadedRecipe(recipe=recipe, path=f"{name}.yaml"))
        timing = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "step_wall_s", "weight_check_s"}
        rows[name] = [{k: v for k, v in json.loads(line).items() if k not in timing and not k.endswith("_s")}
                      for line in (tmp_path / name / "runs" / f"rl-{name}" / "metrics.jsonl").read_text().splitlines()]
    assert len(hashes) == 1
    assert rows["a"] == rows["b"]  # bookkeeping: bit for bit
    first_a, first_c = rows["a"][0], rows["c"][0]
    for key in ("reward_mean", "tokens_trained", "tokens_generated", "response_len_mean"):  # the rollout
        assert first_c[key] == first_a[key], key
    for key in ("loss", "grad_norm", "entropy"):  # the update, accumulated over other micro-batches
        assert first_c[key] == pytest.approx(first_a[key], rel=1e-4, abs=1e-6), key


def test_kv_scales_enter_the_hash_only_once_set():
    base = load_recipe(REPO / "recipes" / "tiny_rl.yaml")
    fp8 = load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rollout.kv_cache_dtype=fp8_e4m3"])
    calibrated = load_recipe(REPO / "recipes" / "tiny_rl.yaml",
                             ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=calibrated"])
    assert len({r.recipe.algorithm_sha256() for r in (base, fp8, calibrated)}) == 3
    assert "kv_cache_dtype" not in base.recipe.hashed()["rollout"]  # recipes written before keep their sha256
    assert "kv_scales" not in fp8.recipe.hashed()["rollout"]


@pytest.mark.parametrize("overrides, error", [
    (["rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.extra_args=[--kv-cache-dtype, fp8_e5m2]"],
     "rollout.kv_cache_dtype is fp8_e4m3 but rollout.sglang carries --kv-cache-dtype fp8_e5m2"),
    (["rollout.kv_scales=calibrated"], "rollout.kv_scales: calibrated scales an FP8 cache"),
    (["rollout.kv_cache_dtype=fp8_e4m3", "rollout.kv_scales=calibrated"],
     "rollout.kv_scales: calibrated with rollout.engine: sglang"),
])
def test_kv_cache_field_and_flag_are_consistent(overrides, error):
    from rlrecipe.recipe.base import RecipeError

    with pytest.raises(RecipeError, match=error.replace("[", r"\[")):
        load_recipe(BOBA, overrides)


def test_the_flag_alone_counts_as_the_kv_storage():
    flagged = load_recipe(BOBA, ["rollout.sglang.extra_args=[--kv-cache-dtype=fp8_e4m3]"]).recipe.rollout
    assert flagged.kv_storage == "fp8_e4m3" and load_recipe(BOBA).recipe.rollout.kv_storage == "auto"
    same = load_recipe(BOBA, ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.extra_args=[--kv-cache-dtype, fp8_e4m3]"])
    assert same.recipe.rollout.kv_storage == "fp8_e4m3"
