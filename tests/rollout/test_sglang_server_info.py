"""A server's version is read from its /server_info, and a failed read is asked again, never kept:
a 0.5.1 server taken for the newest would be sent sampling_seed (HTTP 500 there) and too many new tokens."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.base import SEED_KEY
from rlrecipe.rollout.sglang import fleet as sglang_fleet
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.trajectory.record import SamplingParams, Trajectory

INFO = {"version": "0.5.1", "context_length": 64, "max_req_input_len": 58}


class OldServer(BaseHTTPRequestHandler):
    """A stand-in SGLang 0.5.1 with no model whose /server_info fails (HTTP 503) `failures` times first;
    it answers /generate with one token and keeps each request's sampling_params."""

    protocol_version = "HTTP/1.1"
    failures = 0
    info_asked = 0
    sent: list[dict] = []

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/server_info":
            return self._send(404, {"detail": "Not Found"})
        cls = type(self)
        cls.info_asked += 1
        if cls.failures > 0:
            cls.failures -= 1
            return self._send(503, {"detail": "busy"})
        self._send(200, INFO)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).sent.append(body["sampling_params"])
        self._send(200, {"output_ids": [7], "meta_info": {"id": body["rid"], "finish_reason": {"type": "length"},
                                                          "output_token_logprobs": [[-1.5, 7, None]]}})


@pytest.fixture
def old_server(monkeypatch):
    monkeypatch.setattr(sglang_fleet, "SERVER_INFO_PAUSE_S", 0.01)
    handler = type("Handler", (OldServer,), {"sent": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _seeded(n_prompt: int) -> list[Trajectory]:
    return [Trajectory(uid="a", group_id="g", prompt_ids=list(range(1, n_prompt + 1)), meta={SEED_KEY: 3})]


def test_a_failed_first_server_info_is_asked_again_and_the_real_version_followed(old_server):
    handler, url = old_server
    handler.failures = 1
    eng = SGLangEngine([url], eos_token_id=1)
    try:
        eng.generate(_seeded(20), SamplingParams(max_new_tokens=100))
        assert handler.info_asked == 2
        # 0.5.1: no sampling_seed, and input + new one below the context (64 - 20 - 1)
        assert handler.sent == [{**handler.sent[0], "max_new_tokens": 43}] and "sampling_seed" not in handler.sent[0]
        assert eng.fleet.dialect(0).label() == "0.5.1"
    finally:
        eng.close()


def test_a_server_info_that_keeps_failing_is_an_error_and_the_next_call_asks_again(old_server):
    handler, url = old_server
    handler.failures = sglang_fleet.SERVER_INFO_TRIES
    eng = SGLangEngine([url], eos_token_id=1)
    try:
        with pytest.raises(UserError) as err:
            eng.generate(_seeded(20), SamplingParams(max_new_tokens=100))
        assert f"{url} /server_info failed {sglang_fleet.SERVER_INFO_TRIES} times" in str(err.value)
        assert "503" in str(err.value) and not handler.sent  # nothing sent under guessed rules
        eng.generate(_seeded(20), SamplingParams(max_new_tokens=100))  # the server answers now
        assert handler.info_asked == sglang_fleet.SERVER_INFO_TRIES + 1
        assert handler.sent[0]["max_new_tokens"] == 43 and "sampling_seed" not in handler.sent[0]
    finally:
        eng.close()
