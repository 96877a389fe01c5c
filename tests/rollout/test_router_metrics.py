"""The router's own retries, read from its Prometheus exporter (sglang/router.py RouterWorkers.retries):
the /generate ones summed, other endpoints not, and no figure where the exporter is unknown or down."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import requests

from rlrecipe.rollout.sglang.router import RouterWorkers
from rlrecipe.rollout.sglang.server import ServerProcess
from tests.rollout.test_sglang_client import free_port

# as sglang-router 0.3.2 writes it (taken from its exporter after a server was killed under it)
EXPORTED = """\
# TYPE smg_worker_retries_total counter
smg_worker_retries_total{worker_type="regular",endpoint="generate"} 8
smg_worker_retries_total{worker_type="regular",endpoint="v1/chat/completions"} 5
smg_worker_retries_total{worker_type="prefill",endpoint="generate"} 2
# TYPE smg_worker_errors_total counter
smg_worker_errors_total{worker_type="regular",connection_mode="http",error_type="backend_error"} 8
"""


def _exporter() -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            out = EXPORTED.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _workers(metrics_url: str | None) -> RouterWorkers:
    router = ServerProcess(-1, "http://127.0.0.1:9", [], Path("router.log"), name="sglang-router",
                           metrics_url=metrics_url)
    return RouterWorkers(router, requests.Session)


def test_the_generate_retries_are_summed_over_worker_types():
    httpd = _exporter()
    try:
        assert _workers(f"http://127.0.0.1:{httpd.server_address[1]}/metrics").retries() == 8 + 2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_no_figure_without_an_exporter_or_when_it_does_not_answer():
    assert _workers(None).retries() is None
    assert _workers(f"http://127.0.0.1:{free_port()}/metrics").retries() is None
