"""The released SGLang, served on this CPU by scripts/sglang_cpu/serve.sh from the environment
`make sglang-cpu` installs (.venv-sglang). Without it these tests skip, saying how to install it;
with RLRECIPE_SGLANG_LIVE=1 (CI) a missing environment fails them instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("RLRECIPE_SGLANG_VENV", REPO / ".venv-sglang"))
SERVE = REPO / "scripts" / "sglang_cpu" / "serve.sh"
# the KV pool and context every live server gets (else SGLang sizes the pool from RAM)
SERVER_ARGS = ["--max-total-tokens", "8192", "--context-length", "256"]
# what a run under trainer.lora rank 8 launches its servers with (rollout/sglang/lora.py launch_args)
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2", "--lora-target-modules", "all"]
START_TIMEOUT_S = 240


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.sglang_live)
            item.add_marker(pytest.mark.slow)


def require_sglang() -> None:
    """Skip (or, under RLRECIPE_SGLANG_LIVE=1, fail) where the real SGLang is not installed."""
    if (VENV / ".installed").exists():
        return
    why = f"the released SGLang is not installed at {VENV}: `make sglang-cpu` installs it (about 3 GB)"
    if os.environ.get("RLRECIPE_SGLANG_LIVE") == "1":
        pytest.fail(why + " (RLRECIPE_SGLANG_LIVE=1 asks for the live tests)")
    pytest.skip(why)


def serve_cmd(model: str | Path, port: int, dtype: str = "float32", seed: int = 1) -> list[str]:
    return [str(SERVE), str(model), "127.0.0.1", str(port), dtype, str(seed), *SERVER_ARGS]


class Server:
    """A server process in its own process group (SGLang's scheduler and detokenizer outlive a
    SIGTERM to the launcher alone), its log in a file."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **(env or {})})
        deadline = time.time() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health_generate", timeout=20).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {START_TIMEOUT_S}s: {log.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        try:  # what is left of the group (the scheduler, the detokenizer)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """A model shaped as the demo's (recipes/tiny_sft.yaml: a Qwen2 with a 261-token vocabulary,
    which SGLang pads to 320 rows), saved as an HF directory; never modified."""
    from rlrecipe.modeling import create_tiny
    from rlrecipe.recipe.schema import load_recipe

    tiny = load_recipe(REPO / "recipes" / "tiny_sft.yaml").recipe.model.tiny
    return create_tiny(tiny, tmp_path_factory.mktemp("demo-model") / "model", seed=1)


@pytest.fixture(scope="session")
def demo_model_perturbed(demo_model_dir, tmp_path_factory):
    """The demo-shaped model with every weight moved (another HF directory)."""
    from tests.helpers import perturbed_copy

    return perturbed_copy(demo_model_dir, tmp_path_factory.mktemp("demo-other") / "model", seed=7)


# package scope: the servers stop once tests/live is done (an idle one sleeps, serve.sh's --sleep-on-idle,
# but keeps its memory, and without that flag SGLang's scheduler spins a core while it waits for requests)
@pytest.fixture(scope="package")
def sglang_server(demo_model_dir, tmp_path_factory):
    """One real SGLang server on the demo-shaped model in float32, shared by the tests that leave
    its weights as they found them."""
    require_sglang()
    port = free_port()
    server = Server(serve_cmd(demo_model_dir, port), port, tmp_path_factory.mktemp("sglang") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def standin_server(demo_model_dir, tmp_path_factory):
    """`rlrecipe serve` on the same model, as the stand-in the rest of the suite runs against."""
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "serve", str(demo_model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--context-length", "256"]
    server = Server(cmd, port, tmp_path_factory.mktemp("standin") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def sglang_lora_server(demo_model_dir, tmp_path_factory):
    """The real SGLang on the demo-shaped model with LoRA enabled (LORA_ARGS; serve.sh adds the
    torch_native LoRA backend), for the tests that load adapters."""
    require_sglang()
    port = free_port()
    server = Server(serve_cmd(demo_model_dir, port) + LORA_ARGS, port,
                    tmp_path_factory.mktemp("sglang-lora") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def standin_lora_server(demo_model_dir, tmp_path_factory):
    """`rlrecipe serve` with the same LoRA flags."""
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "serve", str(demo_model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--context-length", "256", *LORA_ARGS]
    server = Server(cmd, port, tmp_path_factory.mktemp("standin-lora") / "server.log")
    yield server
    server.stop()


class Front:
    """An HTTP front before a server: passes every request on, except the paths in `fake` (answered
    200 with SGLang's success body, the server never told: a server that claims an update it did not
    do) and in `hide` (404, as a server without the endpoint). `edit(path, body)` sees each JSON
    request first: it returns the body to pass on, or (status, answer) to answer in the server's place."""

    def __init__(self, target: str, fake: tuple[str, ...] = (), hide: tuple[str, ...] = (), edit=None):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _relay(self, method: str):
                path = self.path.split("?")[0]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path in hide:
                    return self._answer(404, b'{"detail": "Not Found"}')
                if path in fake:
                    return self._answer(200, json.dumps({"success": True, "message": "Succeeded."}).encode())
                if edit is not None and body:
                    edited = edit(path, json.loads(body))
                    if isinstance(edited, tuple):
                        return self._answer(edited[0], json.dumps(edited[1]).encode())
                    body = json.dumps(edited).encode()
                r = requests.request(method, target + self.path, data=body or None, timeout=600,
                                     headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                self._answer(r.status_code, r.content)

            def _answer(self, code: int, payload: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):  # noqa: N802 - stdlib naming
                self._relay("GET")

            def do_POST(self):  # noqa: N802 - stdlib naming
                self._relay("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
