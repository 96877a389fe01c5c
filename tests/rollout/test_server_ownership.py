"""A launched server proves it is the run's own (rlrecipe/rollout/sglang/ownership.py): its port's
listening socket belongs to its process group, and it holds the run's API key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import RolloutSection, SGLangServer
from rlrecipe.rollout.sglang import api_key as api_key_module
from rlrecipe.rollout.sglang import ownership
from rlrecipe.rollout.sglang import server as server_module
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.health import wait_until_healthy
from rlrecipe.rollout.sglang.http_pool import Post
from rlrecipe.rollout.sglang.ownership import _ip, key_proof, listening_inodes, port_owner
from rlrecipe.rollout.sglang.server import ServerProcess, ServerSpec, start_servers
from tests.helpers import serving_in_thread
from tests.ports import free_port

LISTENER = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(8)
print("listening", flush=True); time.sleep(120)
"""


def _listener_process(port: int) -> subprocess.Popen:
    """A process in its own group listening on `port` (as a launched server is)."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def test_proc_net_addresses_are_read_in_host_order():
    assert str(_ip("0100007F")) == "127.0.0.1"
    assert str(_ip("00000000000000000000000001000000")) == "::1"
    assert _ip("00000000").is_unspecified


def test_the_port_owner_is_the_group_holding_its_listening_socket():
    port = free_port()
    assert port_owner("127.0.0.1", port, group=1).state == "none"
    proc = _listener_process(port)
    try:
        assert listening_inodes("127.0.0.1", port)
        assert port_owner("127.0.0.1", port, group=proc.pid).state == "ours"
        other = port_owner("127.0.0.1", port, group=proc.pid + 100000)
        assert other.state == "foreign" and other.holder.startswith(f"PID {proc.pid}: ")
        assert "-c" in other.holder  # its command line, as far as it fits
        # another address of the same port: a connection to 127.0.0.2 reaches no one
        assert port_owner("127.0.0.2", port, group=proc.pid).state == "none"
    finally:
        proc.kill()
        proc.wait()


def test_a_taken_port_stops_the_start_before_its_holder_hears_from_us(tmp_path):
    """The launched server (a sleeping process: it would bind later) loses its port to a listener of
    another group: the wait ends at once, naming the holder, and the holder got no connection."""
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen(8)
    holder.settimeout(0.1)
    launched = ServerProcess(0, f"http://127.0.0.1:{port}", [sys.executable, "-c", "import time; time.sleep(60)"],
                             tmp_path / "server.log")
    launched.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError) as err:
            wait_until_healthy([(launched.url, launched)], timeout=60)
        assert time.monotonic() - t0 < 30  # not the start-up timeout
        message = str(err.value)
        assert f"port {port} on 127.0.0.1 is held by another process (PID " in message
        assert f"not by the server this run launched (PID {launched.proc.pid})" in message
        assert "nothing was sent to it" in message and "\n" not in message
        with pytest.raises(TimeoutError):
            holder.accept()  # the health probe never went there
    finally:
        launched.stop()
        holder.close()


def test_a_foreign_holders_command_line_is_quoted_with_its_key_redacted(tmp_path):
    """Another run's server holds the port, started with its own key on its command line: the
    error naming it shows the command, but not that key."""
    port = free_port()
    (tmp_path / "server.py").write_text(LISTENER)  # a short command line: the error quotes its start
    holder = subprocess.Popen([sys.executable, "server.py", str(port), "--api-key", "another-runs-key",
                               "--admin-api-key=its-admin-key"], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert holder.stdout.readline().strip() == "listening"
    launched = ServerProcess(0, f"http://127.0.0.1:{port}", [sys.executable, "-c", "import time; time.sleep(60)"],
                             tmp_path / "server.log", key="the-runs-key")
    launched.start()
    try:
        with pytest.raises(UserError) as err:
            wait_until_healthy([(launched.url, launched)], timeout=60)
        message = str(err.value)
        assert f"(PID {holder.pid}: " in message and "--api-key *** --admin-api-key=***" in message
        assert "another-runs-key" not in message and "its-admin-key" not in message
    finally:
        launched.stop()
        holder.kill()
        holder.wait()


class Stranger:
    """Another process's server on `port` (here, a thread): 200 to everything, and what it was sent."""

    def __init__(self, port: int):
        heard = self.heard = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 - stdlib naming
                heard.append((self.path, dict(self.headers)))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_POST = do_GET  # noqa: N815 - stdlib naming

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_process_binding_the_port_after_its_check_never_hears_the_key(tmp_path, monkeypatch):
    """The port was free when checked, and a stranger binds it before the health probe: the probe
    reaches it, but without the key, and the proof then refuses it before the key is sent."""
    monkeypatch.setattr(server_module, "foreign_holder", lambda url, pid: None)  # checked before it bound
    port = free_port()
    launched = ServerProcess(0, f"http://127.0.0.1:{port}", [sys.executable, "-c", "import time; time.sleep(60)"],
                             tmp_path / "server.log", key="the-runs-key")
    stranger = Stranger(port)
    launched.start()
    try:
        with pytest.raises(UserError, match="held by another process"):
            wait_until_healthy([(launched.url, launched)], timeout=60)
        assert [path for path, _ in stranger.heard] == ["/health_generate"]
        # no /proc to see the socket by: the proof asks without the key, and the stranger answers
        monkeypatch.setattr(ownership, "listening_inodes", lambda host, port: None)
        with pytest.raises(UserError, match="answers without the API key"):
            wait_until_healthy([(launched.url, launched)], timeout=60)
        assert [path for path, _ in stranger.heard][1:] == ["/health_generate", "/rlrecipe_ownership_proof"]
        assert all("Authorization" not in headers for _, headers in stranger.heard)
    finally:
        launched.stop()
        stranger.close()


# a launched server that takes the key from its environment, as `rlrecipe serve` does: 401 to a
# request without it, 404 to one with it (health paths aside)
KEYED_SERVER = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
key = os.environ.get("SGLANG_API_KEY")
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        keyed = self.headers.get("Authorization") == f"Bearer {key}"
        self.send_response(200 if self.path.startswith("/health") else 404 if keyed else 401)
        self.send_header("Content-Length", "0"); self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_each_fleet_draws_its_own_key_and_attached_servers_never_hear_one(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    fleets: list[ServerFleet] = []
    stranger = Stranger(free_port())
    try:
        for name in ("a", "b"):  # two engines of one process, launched side by side
            cfg = SGLangServer(base_port=free_port(), startup_timeout_s=60,
                               launch_cmd=[sys.executable, "-c", KEYED_SERVER, "{port}"])
            fleets.append(ServerFleet.launch("m", cfg, dtype="float32", run_dir=tmp_path / name, seed=0,
                                             launch_cmd=None, env=None, trainer_gpus=0))
        keys = [f.session().headers["Authorization"] for f in fleets]
        assert keys[0] != keys[1]
        assert requests.get(fleets[0].urls[0] + "/info", headers={"Authorization": keys[1]}, timeout=10).status_code == 401
        assert requests.get(fleets[0].urls[0] + "/info", headers={"Authorization": keys[0]}, timeout=10).status_code == 404
        # a server given by rollout.urls, while both launched fleets hold their keys
        url = f"http://127.0.0.1:{stranger.httpd.server_address[1]}"
        attached = ServerFleet.attach(RolloutSection(engine="sglang", urls=[url]), tmp_path)
        try:
            attached.get_info(0, "server_info")
            attached.http.submit(Post(0, url + "/generate", {}, 10.0)).result(timeout=30)
        finally:
            attached.close()
        assert [path for path, _ in stranger.heard] == ["/health_generate", "/server_info", "/generate"]
        assert all("Authorization" not in headers for _, headers in stranger.heard)
    finally:
        for fleet in fleets:
            fleet.close()
        stranger.close()


@pytest.mark.parametrize("proof, holder_key, refusal", [
    ("socket_and_key", "the-runs-key", "held by another process"),
    ("key", "the-runs-key", None),
    ("key", "another-runs-key", "refuses this run's API key"),
    ("off", "another-runs-key", None),  # nothing is checked
])
def test_a_wrapped_launch_is_taken_on_its_key_with_ownership_proof_key(tmp_path, proof, holder_key, refusal):
    """A launch_cmd through a container (`docker run -p ...`): the process launched is the container's
    client, and another process (docker-proxy) binds the port once the container runs. The default
    proof refuses it, naming the setting; with ownership_proof: key the server's key proves it."""
    port = free_port()
    cfg = SGLangServer(base_port=port, ownership_proof=proof)
    spec = ServerSpec(0, port, 0, f"http://127.0.0.1:{port}", [sys.executable, "-c", "import time; time.sleep(60)"])
    [launched] = start_servers([spec], cfg, tmp_path, key="the-runs-key")
    container = subprocess.Popen([sys.executable, "-c", KEYED_SERVER, str(port)], start_new_session=True,
                                 env={**os.environ, "SGLANG_API_KEY": holder_key})
    try:
        if refusal is None:
            wait_until_healthy([(launched.url, launched)], timeout=60)
        else:
            with pytest.raises(UserError, match=refusal) as err:
                wait_until_healthy([(launched.url, launched)], timeout=60)
            assert "\n" not in str(err.value)
            if proof == "socket_and_key":
                assert "rollout.sglang.ownership_proof: key" in str(err.value)
    finally:
        launched.stop()
        container.kill()
        container.wait()


def test_the_key_proves_a_server_and_a_stranger_is_refused(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, api_key="the-runs-key") as (port, _):
        url = f"http://127.0.0.1:{port}"
        assert key_proof(url, owned=False, key="the-runs-key") is None
        assert "refuses this run's API key" in key_proof(url, owned=False, key="another-runs-key")
    with serving_in_thread(tiny_model_dir) as (port, _):  # takes any client
        url = f"http://127.0.0.1:{port}"
        assert "answers without the API key" in key_proof(url, owned=False, key="the-runs-key")
        # its socket is ours: a launch_cmd that ignores keys
        assert key_proof(url, owned=True, key="the-runs-key") is None


def test_each_fleet_without_a_key_draws_one_for_its_servers(monkeypatch):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    key = api_key_module.fleet_key()
    assert len(key) >= 32 and set(key) <= set("0123456789abcdef")  # never read as a flag: no leading "-"
    assert api_key_module.fleet_key() != key  # two fleets at once: one key each
    assert api_key_module.key_env(key) == {"SGLANG_API_KEY": key}
    assert api_key_module.client_headers(key)["Authorization"] == f"Bearer {key}"
    assert api_key_module.user_key() is None and "Authorization" not in api_key_module.client_headers(None)
    monkeypatch.setenv("SGLANG_API_KEY", "users")  # the user's key wins over a drawn one
    assert api_key_module.fleet_key() == "users" == api_key_module.user_key()
