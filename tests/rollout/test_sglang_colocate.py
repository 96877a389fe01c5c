"""The client's side of a colocated layout against `rlrecipe serve --enable-memory-saver`: release and
resume on every server, the tensor push (weight_sync: tensor) verified, and the launch flag."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import requests
from safetensors.torch import load_file

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.http_pool import Post
from rlrecipe.rollout.sglang.server import server_specs, sglang_launch_cmd
from rlrecipe.rollout.weights.check import WeightMismatch
from rlrecipe.rollout.weights.transport import WeightTransport, weight_transport
from tests.helpers import resume_after_training, serve_process
from tests.rollout.test_sglang_client import stop_process


@pytest.fixture(scope="module")
def colocated(tiny_model_dir, tmp_path_factory):
    proc, url = serve_process(tiny_model_dir, tmp_path_factory.mktemp("colocated") / "serve.log", "--enable-memory-saver")
    yield {"url": url, "proc": proc}
    stop_process(proc)


@pytest.fixture
def engine(colocated, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    eng = SGLangEngine([colocated["url"]], eos_token_id=tok.eos_token_id, served_dtype="float32",
                       cfg=SGLangServer(weight_sync="tensor", weight_sync_bucket_mb=1))
    yield eng
    eng.close()


def _state(model_dir) -> dict:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_a_colocated_step_pushes_tensors_and_verifies_them(engine, colocated, tiny_model_dir, other_model_dir):
    assert engine.transport is WeightTransport.TENSOR
    engine.release_memory()
    resume_after_training(engine, 1, state_dict=_state(other_model_dir))
    assert engine.weights.check.no_checksum == set()  # the checksums were compared
    r = requests.post(colocated["url"] + "/generate", json={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "1"
    # the RL loop's call for non-disk transports (rl/schedule.py) is the same tensor push, verified at once
    engine.update_weights_from_state(_state(tiny_model_dir), 2)
    r = requests.post(colocated["url"] + "/generate", json={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert r.json()["meta_info"]["weight_version"] == "2"


def test_a_colocated_step_by_disk_verifies_after_the_kv_cache_is_back(engine, tiny_model_dir, other_model_dir):
    engine.release_memory()
    resume_after_training(engine, 3, model_dir=other_model_dir)
    engine.release_memory()
    resume_after_training(engine, 4, model_dir=tiny_model_dir)
    with pytest.raises(WeightMismatch):
        engine.verify_export(other_model_dir, 4)  # the check can tell the two apart


def test_release_is_refused_by_the_client_while_a_request_is_in_flight(engine, colocated):
    post = Post(0, colocated["url"] + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True}}, read_timeout_s=120)
    fut = engine.fleet.http.submit(post)
    while not post.sent:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="1 request\\(s\\) still in flight"):
        engine.release_memory()
    assert fut.result(timeout=120)[0] == 200  # never sent: the server lives on
    assert colocated["proc"].poll() is None
    engine.release_memory()  # idle now
    resume_after_training(engine, 5, model_dir=engine.fleet.model_info(0)["model_path"])


def test_a_server_without_the_flag_is_named_with_the_hint(tiny_model_dir, tmp_path):
    proc, url = serve_process(tiny_model_dir, tmp_path / "serve.log")
    try:
        tok = load_tokenizer(tiny_model_dir)
        with SGLangEngine([url], eos_token_id=tok.eos_token_id) as eng:
            with pytest.raises(UserError, match="/release_memory_occupation .* failed: HTTP 400: .*--enable-memory-"
                                                "saver.*launch_cmd or an attached server must carry it"):
                eng.release_memory()
            with pytest.raises(ValueError, match="memory tags"):
                eng.resume_memory(["kv-cache"])
    finally:
        stop_process(proc)


def test_colocate_adds_the_memory_saver_flag_to_launched_servers_only():
    cfg = SGLangServer()
    assert "--enable-memory-saver" in sglang_launch_cmd("m", "h", 1, 0, cfg, "bfloat16", 0, memory_saver=True)
    assert "--enable-memory-saver" not in sglang_launch_cmd("m", "h", 1, 0, cfg, "bfloat16", 0)
    with_extra = SGLangServer(extra_args=["--enable-memory-saver"])
    assert sglang_launch_cmd("m", "h", 1, 0, with_extra, "bfloat16", 0, memory_saver=True).count(
        "--enable-memory-saver") == 1
    template = ["rlrecipe", "serve", "{model}", "--port", "{port}"]
    spec, = server_specs("m", cfg, [0], dtype="float32", seed=0, template=template, memory_saver=True)
    assert "--enable-memory-saver" not in spec.cmd  # a template carries it itself
    # `rlrecipe` at the head of a template is this installation's CLI, whatever PATH holds
    assert spec.cmd == [sys.executable, "-m", "rlrecipe.cli.app", "serve", "m", "--port", str(cfg.base_port)]


def test_weight_sync_tensor_selects_the_tensor_transport():
    assert weight_transport("sglang", SGLangServer(weight_sync="tensor")) is WeightTransport.TENSOR
    assert weight_transport("sglang", SGLangServer(weight_sync="distributed")) is WeightTransport.BROADCAST
    assert weight_transport("sglang", SGLangServer()) is WeightTransport.DISK
