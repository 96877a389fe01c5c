"""The /generate read timeout counts queueing: its allowance is sized from the KV cache the plan gives a server."""

import math
import shutil
from pathlib import Path

from rlrecipe.checks.model_dims import SHIPPED_CONFIGS
from rlrecipe.checks.plan import kv_cache_tokens
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.rollout.sglang.engine import SGLangEngine

REPO = Path(__file__).resolve().parents[2]


def test_without_the_plan_a_request_gets_one_turn():
    eng = SGLangEngine(["http://127.0.0.1:9"], eos_token_id=1, max_concurrency=512)
    try:
        assert eng.gen.queue_turns(32768) == 1
        assert eng.gen.read_timeout(32768) == 300 + 0.05 * 32768
    finally:
        eng.close()


def test_the_32b_evaluation_allows_every_turn_its_512_open_requests_take(tmp_path, capsys):
    ld = load_recipe(REPO / "recipes/32b_200.yaml")
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(SHIPPED_CONFIGS / "deepseek-ai__DeepSeek-R1-Distill-Qwen-32B.json", model / "config.json")
    eng = SGLangEngine(["http://127.0.0.1:9"], eos_token_id=1, max_concurrency=ld.recipe.rollout.sglang.max_concurrency)
    try:
        eng.gen.size_queue_allowance(ld.recipe, model)
        assert eng.kv_tokens == kv_cache_tokens(ld)  # what `rlrecipe plan` says one tp-8 server holds
        seq = ld.recipe.data.max_prompt_tokens + ld.recipe.eval.max_new_tokens
        fit = kv_cache_tokens(ld) // seq
        assert 40 <= fit <= 120  # the "about 53-120 sequences of that length"
        turns = math.ceil(512 / fit)
        assert eng.gen.queue_turns(ld.recipe.eval.max_new_tokens) == turns > 1
        assert eng.gen.read_timeout(ld.recipe.eval.max_new_tokens) == 300 + 0.05 * ld.recipe.eval.max_new_tokens * turns
        # short requests fit more at once: fewer turns
        assert eng.gen.queue_turns(1024) < turns
    finally:
        eng.close()
    err = capsys.readouterr().err
    assert f"holds {fit} sequences of {seq} tokens" in err and f"may wait {turns} turns" in err


def test_launched_servers_get_the_same_allowance_as_attached_ones(tiny_model_dir, tmp_path):
    """The 32B evaluation launches its one tp-8 server: the engine the recipe launches is sized from
    the plan as an attached one is (and its servers are checked against the starting model)."""
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from tests.rollout.test_sglang_client import BOOT_TIMEOUT_S, free_ports, rlrecipe_cmd

    spec = {"run": {"name": "t", "output_dir": str(tmp_path)}, "model": {"path": str(tiny_model_dir)},
            "rollout": {"engine": "sglang", "dtype": "float32", "sglang": {
                "num_servers": 1, "base_port": free_ports(1), "startup_timeout_s": BOOT_TIMEOUT_S,
                "launch_cmd": [*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}",
                               "--dtype", "{dtype}"]}}}
    loaded = LoadedRecipe(recipe=recipe_from_dict(spec), path="launch.yaml")
    eng = SGLangEngine.from_recipe(loaded.recipe, tiny_model_dir, load_tokenizer(tiny_model_dir), run_dir=tmp_path)
    try:
        assert eng.servers and eng.kv_tokens == kv_cache_tokens(loaded)
        assert eng.weight_check_s > 0 and not eng.no_weight_check  # asked at start, and it answered
    finally:
        eng.close()
