"""SGLang server processes: the command lines, the GPU count, the router, and health checks.

Real SGLang needs a GPU, so its command lines are checked argument by argument; the router and
the health polling run for real against `rlrecipe serve` processes, a stand-in router, and
sockets that accept connections and never answer.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import requests
import torch

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import load_recipe, recipe_from_dict
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import auth_headers
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.health import wait_until_healthy
from rlrecipe.rollout.sglang.router import router_launch_cmd, start_router
from rlrecipe.rollout.sglang.server import (
    check_gpus,
    gpus_needed,
    sglang_launch_cmd,
)
from rlrecipe.trajectory.record import SamplingParams, Status
from tests.rollout.test_sglang_client import (
    BOOT_TIMEOUT_S,
    BUDGETED_NEW_TOKENS,
    _budgeted_call,
    check_consistent,
    free_port,
    free_ports,
    prompts,
    recompute,
    rlrecipe_cmd,
    stop_process,
)
from tests.rollout.test_sglang_hang import within_guard

REPO = Path(__file__).resolve().parents[2]

# Accepts connections and reads what comes, never writes a byte back: a hung server.
SILENT = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
print("silent server listening", flush=True)
held = []
while True:
    conn, _ = s.accept(); held.append(conn)
    threading.Thread(target=lambda c=conn: [c.recv(65536) for _ in iter(int, 1)], daemon=True).start()
"""

# A stand-in for sglang-router: /generate round robin over the workers; /health and
# /health_generate 200 once every worker's /health is; GET /stats: requests forwarded per worker.
# Like sglang-router, it forwards the client's bearer key, and no aborts or weight updates (404).
STAND_IN_ROUTER = r"""
import itertools, json, sys, threading, urllib.error, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
host, port, workers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
turn, lock, sent = itertools.count(), threading.Lock(), {w: 0 for w in workers}
def healthy(w):
    try:
        return urllib.request.urlopen(w + "/health", timeout=10).status == 200
    except (OSError, urllib.error.URLError):
        return False
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, data=b""):
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/stats":
            with lock:
                return self._send(200, json.dumps(sent).encode())
        if self.path in ("/health", "/health_generate"):
            return self._send(200 if all(healthy(w) for w in workers) else 503)
        self._send(404)
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/generate":
            return self._send(404)
        with lock:
            w = workers[next(turn) % len(workers)]
            sent[w] += 1
        auth = {"Authorization": self.headers["Authorization"]} if self.headers.get("Authorization") else {}
        req = urllib.request.Request(w + "/generate", data=body, headers={"Content-Type": "application/json", **auth})
        try:
            with urllib.request.urlopen(req) as r:
                self._send(r.status, r.read())
        except urllib.error.HTTPError as err:
            self._send(err.code, err.read())
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 1024
print("stand-in router in front of", " ".join(workers), flush=True)
ThreadingHTTPServer((host, port), H).serve_forever()
"""


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


class SilentListener:
    """A socket in this process that accepts connections and never answers them."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self):
        self._stop.set()
        self._thread.join(5)
        for s in self.held:
            s.close()
        self.sock.close()


# -- command lines ------------------------------------------------------------------------------------
def test_sglang_command_line_places_each_server_on_its_own_gpus():
    cfg = SGLangServer(tp_size=2, dp_size=4, mem_fraction_static=0.7, extra_args=["--enable-deterministic-inference"])
    assert sglang_launch_cmd("/models/m", "127.0.0.1", 30001, 1, cfg, "bfloat16", 7) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/m", "--host", "127.0.0.1",
        "--port", "30001", "--tp-size", "2", "--dp-size", "4", "--mem-fraction-static", "0.7",
        "--dtype", "bfloat16", "--random-seed", "7", "--base-gpu-id", "8",  # server 1 after server 0's 2 x 4
        "--enable-deterministic-inference"]


def test_router_command_line_lists_every_server(monkeypatch):
    cfg = SGLangServer(router=True, router_port=31500, router_policy="round_robin",
                       router_extra_args=["--log-level", "warn"])
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    assert router_launch_cmd(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], cfg, 31999) == [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", "http://10.0.0.1:30000", "http://10.0.0.2:30000",
        "--host", "127.0.0.1", "--port", "31500", "--policy", "round_robin",
        "--request-timeout-secs", "86400", "--prometheus-host", "127.0.0.1", "--prometheus-port", "31999",
        "--log-level", "warn"]
    cmd = router_launch_cmd(["http://10.0.0.1:30000"], cfg, 31999, key="k3y")
    assert cmd[cmd.index("--api-key") + 1] == "k3y" and cmd[-2:] == ["--log-level", "warn"]


class AlwaysHealthy:
    """An HTTP server in this process answering 200 {} to everything: a server the router can list."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 - stdlib naming
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_two_routers_start_side_by_side_on_one_machine(tmp_path):
    """Each gets its own metrics port: with the default, the second exits at start (29000 taken)."""
    pytest.importorskip("sglang_router")
    worker, routers = AlwaysHealthy(), []
    try:
        for k in range(2):
            cfg = SGLangServer(router=True, router_port=free_port(), startup_timeout_s=BOOT_TIMEOUT_S)
            routers.append(start_router([worker.url], cfg, tmp_path / f"r{k}"))
        for router in routers:
            assert router.alive()
            assert requests.get(router.url + "/health", timeout=10).status_code == 200
    finally:
        for router in routers:
            router.stop()
        worker.close()


def test_a_router_whose_metrics_port_is_taken_before_it_binds_it_is_started_again_on_another(
        tmp_path, monkeypatch):
    """The Prometheus port is free when chosen and taken before the router binds it (a connection
    handed that port meanwhile): the router exits at start; it is started again with another port."""
    import socket

    from rlrecipe.rollout.sglang import router as router_module

    pytest.importorskip("sglang_router")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen, free = [], router_module.unused_port

    def taken_first(host: str) -> int:
        chosen.append(free(host) if chosen else taken.getsockname()[1])
        return chosen[-1]

    monkeypatch.setattr(router_module, "unused_port", taken_first)
    worker = AlwaysHealthy()
    router = None
    try:
        cfg = SGLangServer(router=True, router_port=free_port(), startup_timeout_s=BOOT_TIMEOUT_S)
        router = start_router([worker.url], cfg, tmp_path)
        assert len(chosen) == 2 and router.alive()  # the taken port, then one the router bound
        assert router.metrics_url == f"http://127.0.0.1:{chosen[1]}/metrics"
        assert requests.get(router.metrics_url, timeout=10).status_code == 200
        assert router_module.METRICS_PORT_TAKEN in (tmp_path / "sglang_router.log").read_text()
    finally:
        if router is not None:
            router.stop()
        worker.close()
        taken.close()


def test_the_router_never_ends_a_generation_the_client_still_waits_for():
    """Its request timeout outlasts the client's read timeout for the longest generation any shipped
    recipe asks (rollout or evaluation)."""
    from rlrecipe.rollout.sglang.router import ROUTER_REQUEST_TIMEOUT_S

    for path in sorted((REPO / "recipes").glob("*.yaml")):
        r = load_recipe(path).recipe
        s = r.rollout.sglang
        longest = max(r.rollout.max_new_tokens, r.eval.max_new_tokens)
        assert s.request_timeout_s + s.request_timeout_per_token_s * longest < ROUTER_REQUEST_TIMEOUT_S, path


def test_servers_needing_more_gpus_than_the_node_has_are_refused():
    assert gpus_needed(SGLangServer(num_servers=3, tp_size=2, dp_size=4)) == 24
    check_gpus(SGLangServer(num_servers=2, tp_size=2, dp_size=2), visible=8)  # exactly the 8 there are
    with pytest.raises(UserError) as err:
        check_gpus(SGLangServer(num_servers=1, tp_size=8, dp_size=2), visible=8)
    assert "num_servers 1 x tp_size 8 x dp_size 2 = 16 GPUs" in str(err.value) and "has 8" in str(err.value)
    # the 7B recipe's 64 servers do not fit one 8-GPU node: they are spread over its 8 rollout nodes
    recipe = load_recipe(REPO / "recipes" / "7b_boba.yaml").recipe
    with pytest.raises(UserError) as err:
        check_gpus(recipe.rollout.sglang, visible=8)
    msg = str(err.value)
    assert "= 64 GPUs" in msg and "rollout.sglang.num_servers" in msg and "rollout.sglang.nodes" in msg
    assert "rollout.urls" in msg and "trainer" not in msg
    with pytest.raises(UserError, match="= 1 GPUs, but this node .* has 0"):
        check_gpus(SGLangServer(), visible=0)


def test_behind_the_router_servers_may_be_left_out_and_restarted():
    rollout = {"engine": "sglang", "sglang": {"router": True, "retry_on_other_servers": True, "max_restarts": 1}}
    sglang = recipe_from_dict({"run": {"name": "t"}, "model": {"path": "m"}, "rollout": rollout}).rollout.sglang
    assert sglang.router and sglang.retry_on_other_servers and sglang.max_restarts == 1


# -- health --------------------------------------------------------------------------------------------
def test_the_health_wait_returns_once_a_starting_cpu_server_generates(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([*rlrecipe_cmd(), "serve", str(tiny_model_dir), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        within_guard(lambda: wait_until_healthy([(url, None)], BOOT_TIMEOUT_S))
        assert proc.poll() is None
        assert requests.get(url + "/health", timeout=10).status_code == 200
        r = requests.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                          timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    finally:
        stop_process(proc)


def test_an_attached_server_that_never_answers_stops_the_wait_naming_it():
    silent = SilentListener()
    try:
        with pytest.raises(UserError) as err:
            within_guard(lambda: wait_until_healthy([(silent.url, None)], 2.0))
        msg = str(err.value)
        assert f"SGLang server {silent.url} not healthy after 2s" in msg and "ReadTimeout" in msg
        assert silent.held  # it was reached: the probe timed out, bounded by the time left
    finally:
        silent.close()


def test_a_launched_server_that_never_answers_is_named_with_its_log(tmp_path):
    cfg = SGLangServer(base_port=free_ports(1), startup_timeout_s=3,
                       launch_cmd=[sys.executable, "-c", SILENT, "{port}"])
    with pytest.raises(UserError) as err:
        within_guard(lambda: SGLangEngine.launch("fake-model", cfg=cfg, run_dir=tmp_path))
    msg = str(err.value)
    assert f"SGLang server 0 (http://127.0.0.1:{cfg.base_port}) not healthy after 3s" in msg
    assert f"log: {tmp_path / 'sglang_server_0.log'}" in msg
    assert "silent server listening" in (tmp_path / "sglang_server_0.log").read_text()


def test_a_router_that_never_answers_is_named_with_its_log(tmp_path):
    cfg = SGLangServer(router=True, router_port=free_port(), startup_timeout_s=3,
                       router_launch_cmd=[sys.executable, "-c", SILENT, "{port}"])
    with pytest.raises(UserError) as err:
        within_guard(lambda: start_router(["http://127.0.0.1:9"], cfg, tmp_path))
    msg = str(err.value)
    assert f"sglang-router (http://127.0.0.1:{cfg.router_port}) not healthy after 3s" in msg
    assert f"log: {tmp_path / 'sglang_router.log'}" in msg
    with socket.socket() as s:  # stopped: its port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", cfg.router_port))


# -- the router ----------------------------------------------------------------------------------------
def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.loads(r.read())


ROUTERS = {
    "stand-in": [sys.executable, "-c", STAND_IN_ROUTER, "{host}", "{port}", "{worker_urls}"],
    "sglang-router": [],  # the real one, where it is installed
}


@pytest.mark.parametrize("router", ROUTERS)
def test_generation_through_the_router_and_weights_to_every_server(router, tiny_model_dir, other_model_dir, tok,
                                                                   tmp_path):
    if router == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed")
    cfg = SGLangServer(base_port=free_ports(2), num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S, router=True,
                       router_port=free_port(), router_launch_cmd=ROUTERS[router],
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}",
                                   "--dtype", "{dtype}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    procs = [eng.router.proc, *(s.proc for s in eng.servers)]
    try:
        assert eng.router.url == f"http://127.0.0.1:{cfg.router_port}"
        assert (tmp_path / "sglang_router.log").exists()
        base = load_model(tiny_model_dir)
        trajs = eng.generate(prompts(tok, 8), SamplingParams(max_new_tokens=12), seed=1)
        assert all(t.done for t in trajs)
        assert (torch.cat([recompute(base, t) - torch.tensor(t.logp_infer) for t in trajs])).abs().max() < 1e-4
        if router == "stand-in":  # one URL for the client, both servers behind it
            assert sorted(_stats(eng.router.url).values()) == [4, 4]
        # weight updates reach every server directly (the router forwards none)
        eng.update_weights_from_disk(other_model_dir, 1)
        for url in eng.urls:
            assert requests.get(url + "/model_info", headers=auth_headers(eng.fleet.key), timeout=10).json()["weight_version"] == "1"
        # C3PO++ through the router: the servers abort what is in flight, a later call resumes it
        params = SamplingParams(max_new_tokens=BUDGETED_NEW_TOKENS)
        trajs, near = _budgeted_call(eng, tok, params)
        assert near.done
        running = [t for t in trajs if t.status == Status.RUNNING]
        assert running and all(len(t.response_ids) < params.max_new_tokens for t in running)
        eng.generate(trajs, params, seed=3)
        assert all(t.done for t in trajs)
        other = load_model(other_model_dir)
        for t in trajs:
            check_consistent(t)
            if t is near:  # its first tokens are filler
                continue
            assert set(t.versions) == {1}
            assert (recompute(other, t) - torch.tensor(t.logp_infer)).abs().max() < 1e-4
    finally:
        eng.close()
    assert all(p.poll() is not None for p in procs)


def test_max_restarts_needs_retry_on_other_servers():
    rollout = {"engine": "sglang", "sglang": {"max_restarts": 2}}
    with pytest.raises(RecipeError, match="rollout.sglang: .*max_restarts needs retry_on_other_servers"):
        recipe_from_dict({"run": {"name": "t"}, "model": {"path": "m"}, "rollout": rollout})
    rollout["sglang"]["retry_on_other_servers"] = True
    spec = {"run": {"name": "t"}, "model": {"path": "m"}, "rollout": rollout}
    assert recipe_from_dict(spec).rollout.sglang.max_restarts == 2
