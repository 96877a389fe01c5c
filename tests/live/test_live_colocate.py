"""A colocated step against the released SGLang on this CPU: release, resume the weights, push them
by /update_weights_from_tensor (pickled by value, or shared by handle: a shared-memory file's name,
which SGLang's SafeUnpickler admits as it admits a CUDA IPC handle), flush, resume the KV cache,
verify, generate.

On a CPU SGLang runs without --enable-memory-saver (it needs torch_memory_saver and CUDA), so the
release and resume answer 200 and free nothing: what this checks is the protocol (status codes,
bodies, the tensor payload SGLang's SafeUnpickler accepts, the weight-update session) and that
the pushed weights are the ones served. The stand-in (tests/serve/test_serve_colocate.py) holds
the rules a GPU server enforces."""

from __future__ import annotations

import gc

import requests
import torch
from safetensors.torch import load_file

from rlrecipe.modeling import distinct_tensors, load_tokenizer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.tensor_push import tensor_bodies
from rlrecipe.rollout.weights.handle_push import push_by_handles
from tests.helpers import resume_after_training
from tests.live.test_live_engine import PROMPT, _generate, _hf_logprobs
from tests.rollout.test_weight_handles import shared_files


def _weights(model_dir) -> dict:
    return load_file(str(model_dir / "model.safetensors"))


def _served_logprobs_match(url: str, model_dir) -> float:
    out = _generate(url, 1.0)
    ids = PROMPT + out["output_ids"]
    theirs = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] + \
             [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    return float((_hf_logprobs(model_dir, ids) - torch.tensor(theirs)).abs().max())


def test_release_and_resume_answer_200_with_a_null_body(sglang_server):
    url = sglang_server.url
    for path, tags in (("/release_memory_occupation", ["kv_cache", "weights", "cuda_graph"]),
                       ("/resume_memory_occupation", ["weights"]),
                       ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])):
        r = requests.post(url + path, json={"tags": tags}, timeout=120)
        assert (r.status_code, r.json()) == (200, None), (path, r.status_code, r.text)


def test_a_tensor_push_outside_the_session_is_refused_as_the_stand_in_refuses_it(sglang_server, demo_model_dir):
    body = next(tensor_bodies(_weights(demo_model_dir), 0, 1 << 30, 1))
    r = requests.post(sglang_server.url + "/update_weights_from_tensor", json=body, timeout=120)
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"}


def test_a_colocated_step_serves_the_pushed_weights(sglang_server, demo_model_dir, demo_model_perturbed):
    url = sglang_server.url
    tok = load_tokenizer(demo_model_dir)
    assert _served_logprobs_match(url, demo_model_dir) < 1e-4
    with SGLangEngine([url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
        try:
            eng.release_memory()
            resume_after_training(eng, 1, state_dict=_weights(demo_model_perturbed))  # checksums verified inside
            assert eng.weights.check.no_checksum == set()
            assert _served_logprobs_match(url, demo_model_perturbed) < 1e-4
            assert _served_logprobs_match(url, demo_model_dir) > 1e-3  # the two models are told apart
        finally:  # the shared server goes back to the weights it started with
            eng.release_memory()
            resume_after_training(eng, 2, state_dict=_weights(demo_model_dir))
    assert _served_logprobs_match(url, demo_model_dir) < 1e-4


def test_a_push_by_handle_serves_the_pushed_weights(sglang_server, demo_model_dir, demo_model_perturbed):
    """weight_sync: ipc on one trainer rank: each bucket's request carries shared-memory file names,
    and SGLang maps them, loads, and serves exactly those weights."""
    url = sglang_server.url
    tok = load_tokenizer(demo_model_dir)
    perturbed = _weights(demo_model_perturbed)
    with SGLangEngine([url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
        try:
            eng.release_memory()
            eng.resume_memory(["weights"])
            named = distinct_tensors(perturbed)
            bucket = sum(t.numel() * t.element_size() for _, t in named) // 4  # several requests
            sent: list[bool] = []
            with eng.handles_pushed(1, world_size=1) as send:
                pushed = push_by_handles(iter(named), bucket, lambda p, last: (sent.append(last), send(p, last)))
            assert len(sent) >= 4 and sent[-1] and not any(sent[:-1])
            gc.collect()
            assert shared_files() == []  # SGLang let each bucket's memory go once it had loaded it
            eng.flush_cache()
            eng.resume_memory(["kv_cache", "cuda_graph"])
            eng.verify_push(1, state_dict=pushed)  # checksums, bit for bit
            assert eng.weights.check.no_checksum == set()
            assert eng.fleet.weight_version[0] == "1"
            assert _served_logprobs_match(url, demo_model_perturbed) < 1e-4
            assert _served_logprobs_match(url, demo_model_dir) > 1e-3
        finally:
            eng.release_memory()
            resume_after_training(eng, 2, state_dict=_weights(demo_model_dir))
    assert _served_logprobs_match(url, demo_model_dir) < 1e-4
