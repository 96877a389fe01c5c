"""trainer.lora on the released SGLang: the adapter pushed from tensors at every step of an RL run the
recipe's launch_cmd starts, the server's log-probs under an adapter against PEFT's merged model in
float32, and a server that answers a load 200 but keeps serving the old adapter stopped at the push."""

from __future__ import annotations

import pytest
import requests
import torch

from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.weights.adapter import Adapter
from rlrecipe.rollout.weights.check import WeightMismatch
from rlrecipe.rollout.weights.probe import Scores
from tests.helpers import rl_recipe, write_recipe, write_tiny_data
from tests.live.conftest import SERVE, SERVER_ARGS, Front, free_port, require_sglang
from tests.live.test_live_rl import _rl, _rows
from tests.serve.test_serve_lora import peft_adapter, peft_logprobs

PROBE = [[1, 5, 17, 33, 60, 2, 8, 100, 99, 40, 41, 42], [7, 70, 170, 200, 250, 3, 9]]


def _scores(version: int, model) -> Scores:
    return Scores(version, PROBE, [peft_logprobs(model, s) for s in PROBE])


def _engine(url: str, model_dir) -> SGLangEngine:
    tok = load_tokenizer(model_dir)
    return SGLangEngine([url], eos_token_id=tok.eos_token_id, served_dtype="float32",
                        cfg=SGLangServer(weight_sync="tensor"), lora=True)


def test_rl_with_lora_pushes_the_adapter_from_tensors_into_sglang(tmp_path, demo_model_dir):
    require_sglang()
    data = write_tiny_data(tmp_path / "data")
    recipe = rl_recipe(tmp_path, data, str(demo_model_dir), steps=3, c3po={"enabled": False})
    recipe["eval"]["benchmarks"] = []
    recipe["trainer"]["lora"] = {"rank": 8}
    recipe["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 40, "sglang": {
        "base_port": free_port(), "startup_timeout_s": 240, "weight_sync": "tensor",
        "launch_cmd": [str(SERVE), "{model}", "{host}", "{port}", "{dtype}", "{seed}", *SERVER_ARGS, "{lora_args}"]}}
    out = _rl(write_recipe(tmp_path / "rl.yaml", recipe))
    run = tmp_path / "runs" / "rl"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every step samples from the trainer's policy: the base at step 1, the pushed adapter after
    assert all(r["mismatch_abs_logp"] < 1e-4 for r in rows), [r["mismatch_abs_logp"] for r in rows]
    # after each push the probe under the new adapter decided (only the start, on the base, is said)
    unverified = [line for line in (out.stdout + out.stderr).splitlines() if "cannot be verified" in line]
    assert all("at start" in line for line in unverified), unverified
    log = (run / "sglang_server_0.log").read_text()
    assert "--enable-lora" in log and "Using torch_native as backend of LoRA kernels" in log  # serve.sh added it
    assert log.count("POST /load_lora_adapter_from_tensors HTTP/1.1\" 200") == 3  # steps 1..3 pushed
    # an adapter goes one push after it was replaced (an unload waits for requests using it): v1 at step 3
    assert log.count("POST /unload_lora_adapter HTTP/1.1\" 200") == 1
    assert "update_weights_from" not in log  # the base never moved


def test_sglang_log_probs_under_an_adapter_are_the_merged_models(sglang_lora_server, demo_model_dir):
    config, tensors, model = peft_adapter(demo_model_dir, seed=11, rank=8)
    eng = _engine(sglang_lora_server.url, demo_model_dir)
    try:
        eng.expect_logprobs(_scores(1, model))
        eng.update_adapter(Adapter(config, tensors), 1)  # verified by the probe (no earlier push to tell apart)
        got = [eng.fleet.post(0, "/generate", {
            "input_ids": seq, "return_logprob": True, "logprob_start_len": 0, "lora_path": eng.fleet.adapter,
            "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]["input_token_logprobs"][1:] for seq in PROBE]
    finally:
        eng.close()
    diffs = [abs(g[0] - w) for seq_g, seq_w in zip(got, _scores(1, model).logprobs, strict=True)
             for g, w in zip(seq_g, seq_w, strict=True)]
    with torch.no_grad(), model.disable_adapter():
        base = [peft_logprobs(model, s) for s in PROBE]
    moved = max(abs(a - b) for sa, sb in zip(base, _scores(1, model).logprobs, strict=True)
                for a, b in zip(sa, sb, strict=True))
    print(f"max |SGLang - PEFT merged| under the adapter: {max(diffs):.3g} nats; the adapter moved them {moved:.3g}")
    assert max(diffs) < 1e-5 and moved > 1e-2


def test_a_server_keeping_the_old_adapter_is_stopped_at_the_push(sglang_lora_server, demo_model_dir):
    """A front answers the load of version 2's adapter 200 without passing it on, and serves version
    1's under its name."""
    names = {}

    def stale(path, body):
        if path == "/load_lora_adapter_from_tensors" and body.get("lora_name") == names[2]:
            return 200, {"success": True, "error_message": "", "loaded_adapters": {names[2]: "__tensor__"}}
        if path == "/generate" and body.get("lora_path") == names[2]:
            return {**body, "lora_path": names[1]}
        return body

    front = Front(sglang_lora_server.url, edit=stale)
    eng = _engine(front.url, demo_model_dir)
    names.update({v: f"{eng.fleet.adapter_prefix}-v{v}" for v in (1, 2, 3)})
    try:
        config, tensors, model = peft_adapter(demo_model_dir, seed=21, rank=8)
        eng.expect_logprobs(_scores(1, model))
        eng.update_adapter(Adapter(config, tensors), 1)
        config2, tensors2, model2 = peft_adapter(demo_model_dir, seed=22, rank=8)
        eng.expect_logprobs(_scores(2, model2))
        with pytest.raises(WeightMismatch, match="still serves the weights of version 1") as err:
            eng.update_adapter(Adapter(config2, tensors2), 2)
        print(err.value)
        # and a server that answers 200 and loads nothing at all refuses the probe under the new name
        eng.fleet.adapter = names[1]
        eng.expect_logprobs(_scores(3, model2))
        front.close()
        front = Front(sglang_lora_server.url, fake=("/load_lora_adapter_from_tensors",))
        eng.fleet.urls[0] = front.url
        with pytest.raises(WeightMismatch, match=f"refuses the probe under adapter {names[3]}"):
            eng.update_adapter(Adapter(config2, tensors2), 3)
    finally:
        eng.close()
        front.close()
        for name in names.values():  # as the other tests found the server
            requests.post(sglang_lora_server.url + "/unload_lora_adapter", json={"lora_name": name}, timeout=60)
