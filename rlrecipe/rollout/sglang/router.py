"""sglang-router in front of the servers (`rollout.sglang.router`): one URL every /generate goes to.

The router is a CPU-only Rust binary (`pip install sglang-router`); it balances requests over the
servers (`router_policy`) and retries them itself. Weight updates, aborts and server info still go
to each server, since it forwards none of them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import api_key, key_env
from rlrecipe.rollout.sglang.server import (
    ROUTER_LOG_NAME,
    ServerProcess,
    fill_placeholders,
    port_free,
    wait_until_healthy,
)

# The client's read timeout (request_timeout_s + request_timeout_per_token_s x max_new_tokens)
# decides when a /generate has hung. The router's own default, 30 min, would end a long
# generation first: a 32,768-token evaluation sample may take 300 + 0.05 x 32,768 = 1,938 s.
ROUTER_REQUEST_TIMEOUT_S = 24 * 3600


def router_launch_cmd(worker_urls: Sequence[str], cfg: SGLangServer) -> list[str]:
    """`python -m sglang_router.launch_router ...` in front of `worker_urls`, on host:router_port.
    With SGLANG_API_KEY set, the router gets it for its own requests to the servers (it forwards a
    client's bearer key with each /generate either way)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", cfg.host, "--port", str(cfg.router_port), "--policy", cfg.router_policy,
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            *(["--api-key", api_key()] if api_key() else []), *cfg.router_extra_args]


def start_router(worker_urls: Sequence[str], cfg: SGLangServer, run_dir: str | Path | None,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Launch sglang-router in front of healthy servers and wait until it routes; stopped on failure."""
    template = cfg.router_launch_cmd or None
    if template is None and importlib.util.find_spec("sglang_router") is None:
        raise UserError("rollout.sglang.router: sglang-router is not installed here (`pip install "
                        "sglang-router`, part of `make install-gpu`); or set rollout.sglang.router_launch_cmd")
    if not port_free(cfg.host, cfg.router_port):
        raise UserError(f"rollout.sglang.router_port: port {cfg.router_port} on {cfg.host} is already in use")
    if template is None:
        cmd = router_launch_cmd(worker_urls, cfg)
    else:
        cmd = []
        for part in template:  # "{worker_urls}" stands for one argument per server
            cmd += list(worker_urls) if part == "{worker_urls}" else fill_placeholders(
                [part], host=cfg.host, port=cfg.router_port, policy=cfg.router_policy)
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="rlrecipe-sglang-"))
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    router = ServerProcess(-1, f"http://{host}:{cfg.router_port}", cmd, run_dir / ROUTER_LOG_NAME,
                           env={**os.environ, **key_env(), **(env or {})}, name="sglang-router")
    router.start()
    try:
        wait_until_healthy([(router.url, router)], cfg.startup_timeout_s)
    except BaseException:
        router.stop()
        raise
    return router
