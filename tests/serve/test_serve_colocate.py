"""`rlrecipe serve` as a colocated server: the memory endpoints held to SGLang 0.5.23's rules and
stricter (rlrecipe/serve/memory.py says where and why), and /update_weights_from_tensor."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from rlrecipe.modeling import load_model
from rlrecipe.rollout.sglang.tensor_push import tensor_bodies
from rlrecipe.serve.memory import FATAL_EXIT
from tests.helpers import serving_in_thread

PROMPT = [5, 6, 7, 8, 9]
ALL = {"tags": ["kv_cache", "weights", "cuda_graph"]}


class Died(Exception):
    pass


@pytest.fixture
def served(tiny_model_dir):
    """A colocated stand-in (--enable-memory-saver) in a thread; a fatal error raises Died instead of
    ending this process."""
    with serving_in_thread(tiny_model_dir, enable_memory_saver=True, chunk_tokens=4) as (port, sched):
        assert sched.ready.wait(120), "the stand-in did not warm up"
        sched.deaths = []

        def died(message):
            sched.deaths.append(message)
            raise Died(message)

        sched.on_fatal = died
        yield f"http://127.0.0.1:{port}", sched


def post(url: str, path: str, body: dict | None = None):
    r = requests.post(url + path, json=body or {}, timeout=120)
    if "json" not in r.headers.get("Content-Type", ""):
        return r.status_code, r.text
    return r.status_code, r.json()


def generate(url: str) -> tuple[int, dict]:
    return post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                   "sampling_params": {"max_new_tokens": 6, "temperature": 0}})


def push(url: str, state: dict, version: int) -> None:
    assert post(url, "/begin_weight_update")[0] == 200
    for body in tensor_bodies(state, version, 1 << 16, 1):  # small buckets: several requests
        code, answer = post(url, "/update_weights_from_tensor", body)
        assert (code, answer) == (200, {"success": True, "message": "Success"})
    assert post(url, "/end_weight_update")[0] == 200


def test_release_is_refused_without_enable_memory_saver(tiny_model_dir):
    with serving_in_thread(tiny_model_dir) as (port, _):
        url = f"http://127.0.0.1:{port}"
        code, body = post(url, "/release_memory_occupation", ALL)
        assert code == 400 and "--enable-memory-saver" in body["error"]["message"]
        assert post(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400
        assert generate(url)[0] == 200  # nothing was released


def test_unknown_tags_are_refused_and_null_means_all(served):
    url, sched = served
    code, body = post(url, "/release_memory_occupation", {"tags": ["kv-cache"]})
    assert code == 400 and "unknown tag 'kv-cache'" in body["error"]["message"]
    assert post(url, "/release_memory_occupation", {"tags": None}) == (200, None)
    assert sched.memory.released == {"kv_cache", "weights", "cuda_graph"}


@pytest.mark.parametrize("tag", ["weights", "kv_cache"])
def test_generate_while_released_is_refused(served, tag):
    url, _ = served
    assert post(url, "/release_memory_occupation", {"tags": [tag]}) == (200, None)
    code, body = generate(url)
    assert code == 400 and f"{tag} memory is released" in body["error"]["message"]
    assert requests.get(url + "/health_generate", timeout=60).status_code == 503


def test_resumed_weights_are_not_the_old_ones_until_a_push_lands(served, tiny_model_dir):
    url, sched = served
    before = requests.get(url + "/weights_checker", timeout=60).json()["ranks"][0]["checksums"]
    code, first = generate(url)
    assert code == 200
    assert post(url, "/release_memory_occupation", ALL) == (200, None)
    # a disk update into released weights is refused: SGLang would write into unmapped memory
    code, body = post(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})
    assert code == 400 and "released" in body["message"]
    assert post(url, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
    assert post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    code, body = generate(url)
    assert code == 400 and "push the weights" in body["error"]["message"]
    after = requests.get(url + "/weights_checker", timeout=60).json()["ranks"][0]["checksums"]
    assert all(after[name] != before[name] for name, _ in sched.engine.model.named_parameters())
    # half a push still refuses: every resumed tensor must be written again
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    half = dict(list(state.items())[: len(state) // 2])
    push(url, half, 1)
    assert generate(url)[0] == 400
    push(url, state, 1)
    code, again = generate(url)
    assert code == 200 and again["output_ids"] == first["output_ids"]


def test_a_tensor_push_serves_the_pushed_weights(served, other_model_dir):
    url, _ = served
    assert post(url, "/release_memory_occupation", ALL) == (200, None)
    assert post(url, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
    push(url, load_file(str(Path(other_model_dir) / "model.safetensors")), 4)
    assert post(url, "/flush_cache")[0] == 200
    assert post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    code, out = generate(url)
    assert code == 200 and out["meta_info"]["weight_version"] == "4"
    ids = PROMPT + out["output_ids"]
    with torch.no_grad():
        logits = load_model(other_model_dir).eval()(torch.tensor([ids])).logits[0, :-1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    theirs = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
                          + [e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert float((ours - theirs).abs().max()) < 1e-4


def test_a_tensor_push_outside_the_session_and_a_misfit_tensor_are_refused(served, tiny_model_dir):
    url, _ = served
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    body = next(tensor_bodies(state, 1, 1 << 30, 1))
    assert post(url, "/update_weights_from_tensor", body) == (400, {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"})
    assert post(url, "/begin_weight_update")[0] == 200
    name = "model.norm.weight"
    code, answer = post(url, "/update_weights_from_tensor", next(tensor_bodies({name: state[name][:-1]}, 1, 1 << 30, 1)))
    assert code == 400 and name in answer["message"]
    # a payload that names code to run is refused by the unpickler, as SGLang's SafeUnpickler refuses it
    import base64
    import pickle
    evil = base64.b64encode(pickle.dumps([("x", print)])).decode()
    code, answer = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert code == 400 and "builtins.print is not admitted" in answer["message"]


def test_a_resume_of_a_tag_not_released_is_fatal(served):
    url, sched = served
    assert post(url, "/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    with pytest.raises(requests.RequestException):  # the handler dies with the server: no answer
        post(url, "/resume_memory_occupation", {"tags": ["weights"]})
    assert len(sched.deaths) == 1 and "'weights', which is not released" in sched.deaths[0]


def test_a_release_with_a_request_in_flight_ends_the_server(tiny_model_dir, tmp_path):
    from tests.helpers import serve_process

    log = tmp_path / "serve.log"
    proc, url = serve_process(tiny_model_dir, log, "--enable-memory-saver")
    port = int(url.rsplit(":", 1)[1])
    try:
        # a stream whose first event has come is a request the scheduler is running
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/generate", body=json.dumps(
            {"input_ids": PROMPT, "stream": True,
             "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}}),
            headers={"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline()  # the first event's chunk
        with pytest.raises(requests.RequestException):
            requests.post(url + "/release_memory_occupation", json=ALL, timeout=60)
        assert proc.wait(timeout=60) == FATAL_EXIT
        assert "should be called only when server is idle" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
