"""`rlrecipe serve` answers bad requests with 400 and keeps serving everyone else."""

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import serving_in_thread


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, join_timeout_s=1.0) as port_and_scheduler:
        yield port_and_scheduler


def post(port: int, path: str, body: bytes, headers: dict | None = None, timeout: float = 60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else None


def generate(port, ids, **sp):
    sp = {"max_new_tokens": 4, "temperature": 0, **sp}
    return post(port, "/generate", json.dumps({"input_ids": ids, "sampling_params": sp}).encode())


def test_an_out_of_vocabulary_id_fails_only_its_own_request(served):
    port, sched = served
    good = [[5, 6, 7 + i] for i in range(8)]
    bad = [[5, sched.vocab_size], [5, -1]]
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda ids: generate(port, ids), good + bad))
    assert [code for code, _ in answers] == [200] * 8 + [400, 400]
    assert all(body["meta_info"]["finish_reason"]["type"] in ("length", "stop") and body["output_ids"]
               for _, body in answers[:8])
    assert f"token id {sched.vocab_size} is outside the vocabulary (0..{sched.vocab_size - 1})" in answers[8][1]["error"]["message"]
    assert "token id -1 is outside" in answers[9][1]["error"]["message"]


@pytest.mark.parametrize("body", [b'{"input_ids": {"a": 1}}', b'{"text": 5}', b'{"input_ids": [[1], "x"]}',
                                  b'{"input_ids": [1, 2], "sampling_params": [1]}', b"{not json",
                                  b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
                                  b'{"input_ids": [1, true]}'])
def test_malformed_bodies_get_400(served, body):
    port, _ = served
    code, answer = post(port, "/generate", body)
    assert code == 400 and set(answer) == {"error"} and answer["error"]["message"]  # SGLang 0.5.23's shape


def test_a_negative_content_length_gets_400_not_a_hang(served):
    port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        body = json.loads(resp.read())
    assert resp.status == 400 and body["error"]["message"] == "Content-Length must not be negative"


def test_joining_a_weight_group_at_an_unreachable_address_gives_up(served):
    port, _ = served
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": closed, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}
    code, answer = post(port, "/init_weights_update_group", json.dumps(body).encode())
    assert code == 400 and answer["success"] is False and "Failed to initialize" in answer["message"]
    assert generate(port, [5, 6])[0] == 200  # still serving


def get(port: int, path: str, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_health_answers_as_sglang_does(served):
    port, sched = served
    assert sched.ready.wait(60)  # its warm-up generation went through
    assert get(port, "/health") == (200, b"")  # no generation behind it
    assert get(port, "/health_generate") == (200, b"")  # one token generated
    sched.ready.clear()  # as while it warms up (or shuts down): 503 on both, as SGLang
    try:
        assert get(port, "/health")[0] == 503 and get(port, "/health_generate")[0] == 503
    finally:
        sched.ready.set()
    assert get(port, "/health")[0] == 200