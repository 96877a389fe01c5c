"""A server killed behind the real sglang-router and started again, on `rlrecipe serve` servers:
the requests cut on it are sent again, the router stops listing it at once and lists it again only
after a push gave it the current weights (the scenario is tests/rollout/router_recovery.py's)."""

from __future__ import annotations

import importlib.util

import pytest

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from tests.rollout.router_recovery import killed_and_restarted_behind_the_router
from tests.rollout.test_sglang_client import (
    BOOT_TIMEOUT_S,
    free_port,
    free_ports,
    prompts,
    recompute,
    rlrecipe_cmd,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                 reason="sglang-router is not installed (make install adds it)")]


def test_a_server_killed_behind_the_router_is_restarted_and_taken_back_at_a_push(tiny_model_dir, other_model_dir,
                                                                                 tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    cfg = SGLangServer(base_port=free_ports(2), num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S, router=True,
                       router_port=free_port(), router_policy="round_robin", retry_on_other_servers=True,
                       max_restarts=1,
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}",
                                   "--dtype", "{dtype}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    try:
        killed_and_restarted_behind_the_router(
            eng, prompts(tok, 16), 96, recompute, load_model(tiny_model_dir), load_model(other_model_dir),
            lambda: eng.update_weights_from_disk(other_model_dir, 1))
    finally:
        eng.close()
