"""The SGLang client against servers that stop answering: a read timeout sized to max_new_tokens,
an error naming the server, or (retry_on_other_servers) its requests moved to the others; and a
bounded number of requests open per server, all from one client thread."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request

import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.health import probe_health
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory
from tests.ports import free_ports

GUARD_S = 120  # only a guard against a stalled test; the assertions are on the errors

# A stand-in SGLang server with no model: answers /generate after `delay` seconds with one token
# (port % 1000), and reports on GET /stats the most /generate requests it ever had open at once.
STAND_IN = r"""
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, delay = int(sys.argv[1]), float(sys.argv[2])
lock, state = threading.Lock(), {"open": 0, "peak": 0, "served": 0}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(dict(state) if self.path == "/stats" else {"model_path": "fake"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path != "/generate":
            return self._send({"success": True})
        with lock:
            state["open"] += 1; state["peak"] = max(state["peak"], state["open"])
        time.sleep(delay)
        with lock:
            state["open"] -= 1; state["served"] += 1
        tok = port % 1000
        self._send({"output_ids": [tok], "meta_info": {"id": body["rid"], "finish_reason": {"type": "length"},
                                                       "output_token_logprobs": [[-1.5, tok, None]]}})
ThreadingHTTPServer.request_queue_size = 1024
ThreadingHTTPServer.daemon_threads = True
print("stand-in listening", flush=True)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def within_guard(fn):
    """Run fn in a thread; its result or exception, or a failure if it is still running at the guard."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(GUARD_S)
    assert not th.is_alive(), "the client stalled"
    if "error" in box:
        raise box["error"]
    return box["value"]


def launch(tmp_path, n: int, delay: float = 0.0, **cfg) -> SGLangEngine:
    """n stand-ins, each already asked once (as a run in progress has: /server_info is known)."""
    cfg = SGLangServer(base_port=free_ports(n), num_servers=n, startup_timeout_s=60,
                       launch_cmd=[sys.executable, "-c", STAND_IN, "{port}", str(delay)], **cfg)
    eng = SGLangEngine.launch("fake-model", cfg=cfg, run_dir=tmp_path, eos_token_id=1)
    eng.generate(trajs(n), SamplingParams(max_new_tokens=1))
    return eng


def trajs(n: int) -> list[Trajectory]:
    return [Trajectory(uid=str(i), group_id=str(i), prompt_ids=[5, 6]) for i in range(n)]


def test_a_server_that_accepts_and_never_answers_fails_its_request_by_the_read_timeout():
    # accepts connections and reads the request, never writes a byte back
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    cfg = SGLangServer(request_timeout_s=1.0, request_timeout_per_token_s=0.02)
    eng = SGLangEngine([url], eos_token_id=1, cfg=cfg)
    try:
        eng.fleet.server_infos[0] = {}  # the silent server would not answer /server_info either
        assert eng.gen.read_timeout(50) == pytest.approx(2.0)  # 1 s floor + 50 tokens x 0.02 s
        with pytest.raises(UserError) as err:
            within_guard(lambda: eng.generate(trajs(3), SamplingParams(max_new_tokens=50)))
        msg = str(err.value)
        assert url in msg and "did not answer /generate within 2 s" in msg and "request_timeout_s" in msg
        assert held  # it was reached: the error is the read timeout, not a refused connection
    finally:
        eng.close()
        stop.set()
        acceptor.join(5)
        for s in held:
            s.close()
        listener.close()


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def test_open_requests_are_bounded_per_server_and_one_thread_drives_them(tmp_path):
    eng = launch(tmp_path, 2, delay=0.2, max_concurrency=24)
    threads, done = [], threading.Event()

    def count():
        while not done.is_set():
            threads.append(threading.active_count())
            time.sleep(0.01)

    counter = threading.Thread(target=count, daemon=True)
    try:
        base = threading.active_count() + 1  # with the counter
        counter.start()
        out = within_guard(lambda: eng.generate(trajs(200), SamplingParams(max_new_tokens=1)))
        done.set()
        counter.join(5)
        assert all(t.status == Status.TRUNCATED and len(t.response_ids) == 1 for t in out)
        stats = [_stats(u) for u in eng.urls]
        assert [s["served"] for s in stats] == [101, 101]  # and one each at launch  # groups alternate between the servers
        assert [s["peak"] for s in stats] == [24, 24]  # the bound, reached and never passed
        # 48 requests open at a time, on the caller's thread, the pool's one and asyncio's few resolver threads
        assert max(threads) - base <= 1 + min(32, (os.cpu_count() or 1) + 4)
    finally:
        done.set()
        eng.close()


def test_a_frozen_server_is_named_in_the_error(tmp_path):
    eng = launch(tmp_path, 2, request_timeout_s=1.0, request_timeout_per_token_s=0.0)
    stopped = eng.servers[1].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        with pytest.raises(UserError) as err:
            within_guard(lambda: eng.generate(trajs(4), SamplingParams(max_new_tokens=8)))
        msg = str(err.value)
        assert "SGLang server 1" in msg and eng.urls[1] in msg and "did not answer /generate within 1 s" in msg
        assert str(tmp_path / "sglang_server_1.log") in msg
    finally:
        os.kill(stopped, signal.SIGCONT)
        eng.close()


def test_with_retry_a_frozen_servers_requests_finish_on_the_others(tmp_path, capsys):
    eng = launch(tmp_path, 3, request_timeout_s=1.0, request_timeout_per_token_s=0.0, retry_on_other_servers=True)
    tokens = [int(u.rsplit(":", 1)[1]) % 1000 for u in eng.urls]
    stopped = eng.servers[1].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        out = within_guard(lambda: eng.generate(trajs(9), SamplingParams(max_new_tokens=8)))
        assert all(t.status == Status.TRUNCATED for t in out)
        got = [t.response_ids for t in out]
        assert all(len(r) == 1 and r[0] in (tokens[0], tokens[2]) for r in got)  # nothing from server 1
        assert eng.live == [0, 2]
        shown = capsys.readouterr()
        assert "SGLang server 1" in shown.out + shown.err
        # from now on it is left out: generation and weight updates go to the others only
        within_guard(lambda: eng.update_weights_from_disk(tmp_path, 1))
        assert eng.version == 1
        again = within_guard(lambda: eng.generate(trajs(4), SamplingParams(max_new_tokens=8)))
        assert [t.response_ids[0] for t in again] == [tokens[0], tokens[2]] * 2
    finally:
        os.kill(stopped, signal.SIGCONT)
        eng.close()


def test_with_retry_and_every_server_frozen_the_error_says_so(tmp_path):
    eng = launch(tmp_path, 1, request_timeout_s=1.0, request_timeout_per_token_s=0.0, retry_on_other_servers=True)
    pid = eng.servers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(UserError, match="SGLang server 0 .*no SGLang server left to retry on"):
            within_guard(lambda: eng.generate(trajs(2), SamplingParams(max_new_tokens=8)))
    finally:
        os.kill(pid, signal.SIGCONT)
        eng.close()


def test_a_dead_server_is_started_again_and_taken_back_at_the_next_weight_update(tmp_path, capsys):
    """retry_on_other_servers with max_restarts 1: server 1 dies, its share goes to the others, it
    is started again at once, and the first weight update after it answers takes it back (with
    that update's weights); when it dies a second time it stays out."""
    eng = launch(tmp_path, 3, request_timeout_s=5.0, request_timeout_per_token_s=0.0, retry_on_other_servers=True,
                 max_restarts=1)
    tokens = [int(u.rsplit(":", 1)[1]) % 1000 for u in eng.urls]
    first = eng.servers[1].proc.pid
    try:
        eng.servers[1].proc.kill()
        eng.servers[1].proc.wait(timeout=30)
        out = within_guard(lambda: eng.generate(trajs(6), SamplingParams(max_new_tokens=8)))
        assert {t.response_ids[0] for t in out} == {tokens[0], tokens[2]} and eng.live == [0, 2]
        deadline = time.monotonic() + GUARD_S
        while not (eng.servers[1].alive() and probe_health(eng.urls[1], 5) is None):
            assert time.monotonic() < deadline, "server 1 was not started again"
            time.sleep(0.2)
        assert eng.servers[1].proc.pid != first
        assert eng.live == [0, 2]  # answering is not enough: it waits for weights
        within_guard(lambda: eng.update_weights_from_disk(tmp_path, 1))
        assert eng.live == [0, 1, 2] and eng.fleet.weight_version == ["1", "1", "1"]
        assert {k: eng.fleet_metrics()[k] for k in ("rollout_servers_live", "rollout_server_restarts")} == {
            "rollout_servers_live": 3.0, "rollout_server_restarts": 1.0}
        again = within_guard(lambda: eng.generate(trajs(6), SamplingParams(max_new_tokens=8)))
        assert [t.response_ids[0] for t in again] == tokens * 2  # group i goes to live server i % 3
        shown = capsys.readouterr()
        text = " ".join((shown.out + shown.err).split())
        assert "starting SGLang server 1 again (0 restarts left)" in text
        assert "answers again: taken back with the weights of version 1" in text
        # its restarts are used up: a second death leaves it out for good
        eng.servers[1].proc.kill()
        eng.servers[1].proc.wait(timeout=30)
        within_guard(lambda: eng.generate(trajs(3), SamplingParams(max_new_tokens=8)))
        within_guard(lambda: eng.update_weights_from_disk(tmp_path, 2))
        assert eng.live == [0, 2] and not eng.servers[1].alive()
        assert {k: eng.fleet_metrics()[k] for k in ("rollout_servers_live", "rollout_server_restarts")} == {
            "rollout_servers_live": 2.0, "rollout_server_restarts": 1.0}
    finally:
        eng.close()


def test_a_hung_server_is_killed_before_it_is_started_again(tmp_path):
    """A server that stops answering (SIGSTOP: alive, silent) is left out, its process group killed
    (it would hold its GPU), and a new one started on its port."""
    eng = launch(tmp_path, 2, request_timeout_s=1.0, request_timeout_per_token_s=0.0, retry_on_other_servers=True,
                 max_restarts=1)
    frozen = eng.servers[1].proc
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        within_guard(lambda: eng.generate(trajs(4), SamplingParams(max_new_tokens=8)))
        assert eng.live == [0]
        deadline = time.monotonic() + GUARD_S
        while not (eng.servers[1].proc is not frozen and probe_health(eng.urls[1], 5) is None):
            assert time.monotonic() < deadline, "server 1 was not started again"
            time.sleep(0.2)
        assert frozen.poll() == -signal.SIGKILL  # SIGTERM cannot reach a stopped process; SIGKILL did
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen.pid, signal.SIGCONT)
        eng.close()
