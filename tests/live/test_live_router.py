"""The real sglang-router in front of two released SGLang servers: generation through it, weights
pushed to each server, C3PO++'s aborts, then a server killed mid-generation, started again and
taken back at a push (that scenario is tests/rollout/router_recovery.py's, also run on `rlrecipe
serve`). One test: starting two real servers is most of its time."""

from __future__ import annotations

import pytest
import requests
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import auth_headers
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.trajectory.record import SamplingParams, Status
from tests.live.conftest import SERVE, SERVER_ARGS, START_TIMEOUT_S, free_port, require_sglang
from tests.rollout.router_recovery import killed_and_restarted_behind_the_router, router_lists
from tests.rollout.test_sglang_client import _budgeted_call, check_consistent, free_ports, prompts, recompute

pytest.importorskip("sglang_router")


def test_through_the_router_pushes_aborts_and_a_server_killed_then_taken_back(
        demo_model_dir, demo_model_perturbed, tmp_path):
    require_sglang()
    tok = load_tokenizer(demo_model_dir)
    cfg = SGLangServer(base_port=free_ports(2), num_servers=2, startup_timeout_s=START_TIMEOUT_S, router=True,
                       router_port=free_port(), router_policy="round_robin", retry_on_other_servers=True,
                       max_restarts=1,
                       launch_cmd=[str(SERVE), "{model}", "{host}", "{port}", "{dtype}", "{seed}", *SERVER_ARGS])
    eng = SGLangEngine.launch(demo_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    base, other = load_model(demo_model_dir), load_model(demo_model_perturbed)
    try:
        assert router_lists(eng) == dict.fromkeys(eng.urls, True)
        trajs = eng.generate(prompts(tok, 8), SamplingParams(max_new_tokens=12), seed=1)
        assert all(t.done for t in trajs)
        assert torch.cat([recompute(base, t) - torch.tensor(t.logp_infer) for t in trajs]).abs().max() < 1e-4
        # the push goes to each server (the router forwards none)
        eng.update_weights_from_disk(demo_model_perturbed, 1)
        for url in eng.urls:
            info = requests.get(url + "/model_info", headers=auth_headers(eng.fleet.key), timeout=10).json()
            assert info["weight_version"] == "1"
        # C3PO++: the budget is reached, every server aborts what is in flight, a later call resumes it
        params = SamplingParams(max_new_tokens=96)
        trajs, near = _budgeted_call(eng, tok, params)
        assert near.done
        running = [t for t in trajs if t.status == Status.RUNNING]
        assert running and all(len(t.response_ids) < params.max_new_tokens for t in running)
        eng.generate(trajs, params, seed=3)
        for t in trajs:
            assert t.done
            check_consistent(t)
            if t is not near:  # its first tokens are filler
                assert set(t.versions) == {1}
                assert (recompute(other, t) - torch.tensor(t.logp_infer)).abs().max() < 1e-4
        # a server killed while requests are in flight on it; back at the push of version 2 (the base again)
        killed_and_restarted_behind_the_router(eng, prompts(tok, 16), 64, recompute, other, base,
                                               lambda: eng.update_weights_from_disk(demo_model_dir, 2))
    finally:
        eng.close()
