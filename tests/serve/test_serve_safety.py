"""`rlrecipe serve` under bad updates and bad requests: a failed weight update changes nothing that
is served, oversized requests are refused, one big request does not hold the others back."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading

import pytest
from safetensors.torch import load_file, save_file

from rlrecipe.serve.http_server import MAX_BODY_BYTES, MAX_TENSOR_BODY_BYTES
from rlrecipe.serve.protocol import MAX_N, MAX_SAMPLES_PER_REQUEST
from tests.helpers import serving_in_thread


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, max_batch=4, chunk_tokens=4) as port_and_scheduler:
        yield port_and_scheduler


def post(port: int, path: str, body: dict, timeout: float = 120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else None


def greedy(port: int) -> list[int]:
    code, body = post(port, "/generate", {"input_ids": [5, 6, 7, 8],
                                          "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert code == 200, body
    return body["output_ids"]


def _sharded_export(src, dst, break_last: bool):
    """`src`'s weights in two shards with an index; the second shard's tensor has the wrong shape
    when `break_last` (a loader copying tensor by tensor would have copied the first shard already)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(src / "model.safetensors")
    last = "model.norm.weight"
    first = {k: v for k, v in weights.items() if k != last}
    second = {last: weights[last][:-1].clone() if break_last else weights[last]}
    save_file(first, dst / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, dst / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map[last] = "model-00002-of-00002.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_a_failed_weight_update_leaves_the_served_model_as_it_was(served, other_model_dir, tmp_path):
    port, sched = served
    before = greedy(port)
    version = sched.weight_version
    broken = _sharded_export(other_model_dir, tmp_path / "broken", break_last=True)
    code, body = post(port, "/update_weights_from_disk", {"model_path": str(broken), "weight_version": "v-bad"})
    assert code == 400 and not body["success"] and "model.norm.weight" in body["message"]
    assert greedy(port) == before and sched.weight_version == version
    truncated = tmp_path / "truncated"
    shutil.copytree(other_model_dir, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, body = post(port, "/update_weights_from_disk", {"model_path": str(truncated)})
    assert code == 400 and greedy(port) == before
    # the same weights, whole: the update goes through and the output changes (so the check above can fail)
    good = _sharded_export(other_model_dir, tmp_path / "good", break_last=False)
    code, body = post(port, "/update_weights_from_disk", {"model_path": str(good), "weight_version": "v2"})
    assert code == 200 and body["success"], body
    changed = greedy(port)
    assert changed != before and sched.weight_version == "v2"
    code, _ = post(port, "/update_weights_from_disk", {"model_path": str(broken)})
    assert code == 400 and greedy(port) == changed


@pytest.mark.parametrize(("sampling", "said"), [
    ({"n": MAX_N + 1}, f"sampling_params.n must be an integer from 1 to {MAX_N}"),
    ({"n": True}, "sampling_params.n must be an integer"),
    ({"max_new_tokens": 1e400}, "sampling_params.max_new_tokens must be an integer, not inf"),
    ({"max_new_tokens": "8"}, "sampling_params.max_new_tokens must be an integer"),
    ({"top_k": 1e400}, "sampling_params.top_k must be an integer, not inf"),
])
def test_out_of_range_sampling_params_get_400(served, sampling, said):
    port, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    raw = json.dumps({"input_ids": [5, 6], "sampling_params": sampling}).replace("Infinity", "1e400")
    conn.request("POST", "/generate", body=raw.encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 400 and said in body["error"]["message"]


def test_too_many_samples_in_one_request_get_400(served):
    port, sched = served
    prompts = [[5, 6]] * (MAX_SAMPLES_PER_REQUEST // MAX_N + 1)
    code, body = post(port, "/generate", {"input_ids": prompts, "sampling_params": {"n": MAX_N, "max_new_tokens": 1}})
    assert code == 400 and f"more than {MAX_SAMPLES_PER_REQUEST} samples" in body["error"]["message"]
    assert not sched.pending and not sched.active  # nothing of it was queued


@pytest.mark.parametrize(("request_line", "limit"), [(b"POST /generate", MAX_BODY_BYTES),
                                                     (b"POST /update_weights_from_disk", MAX_BODY_BYTES),
                                                     (b"GET /get_weights_by_name", MAX_BODY_BYTES),
                                                     (b"POST /update_weights_from_tensor", MAX_TENSOR_BODY_BYTES)])
def test_a_huge_content_length_gets_413_without_the_body_being_read(served, request_line, limit):
    port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        # the headers alone: a server that tried to read 10^12 bytes would never answer
        s.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        body = json.loads(resp.read())
    assert resp.status == 413 and f"at most {limit}" in body["error"]["message"]
    assert greedy(port)  # still serving


def test_a_big_request_takes_turns_with_a_small_one(served):
    """n=64 samples of 64 tokens on an engine of 4 slots: 16 chunks' worth of rows per turn. A request
    sent while it runs is answered while it is still running, not after it."""
    port, sched = served
    big: dict = {}

    def send_big():
        big["answer"] = post(port, "/generate", {"input_ids": [5, 6], "sampling_params": {
            "n": 64, "max_new_tokens": 64, "ignore_eos": True, "temperature": 1.0}}, timeout=600)

    thread = threading.Thread(target=send_big)
    thread.start()
    while not any(r.chunks for r in list(sched.active)):  # the big one is decoding
        thread.join(0.01)
    small = greedy(port)
    assert small and thread.is_alive()  # answered while the big request still runs
    thread.join(600)
    code, body = big["answer"]
    assert code == 200 and len(body) == 64 and all(len(b["output_ids"]) == 64 for b in body)