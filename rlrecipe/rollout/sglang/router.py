"""sglang-router in front of the servers (`rollout.sglang.router`): one URL every /generate goes to.

The router is a CPU-only Rust binary (`pip install sglang-router`); it balances requests over the
servers (`router_policy`) and retries them itself. Weight updates, aborts and server info still go
to each server, since it forwards none of them. With retry_on_other_servers, the fleet keeps the
router's list of servers to those it may sample from (`RouterWorkers`).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import key_env
from rlrecipe.rollout.sglang.health import wait_until_healthy
from rlrecipe.rollout.sglang.server import (
    ROUTER_LOG_NAME,
    ServerProcess,
    fill_placeholders,
    port_free,
)

# The client's read timeout (request_timeout_s + request_timeout_per_token_s x max_new_tokens)
# decides when a /generate has hung. The router's own default, 30 min, would end a long
# generation first: a 32,768-token evaluation sample may take 300 + 0.05 x 32,768 = 1,938 s.
ROUTER_REQUEST_TIMEOUT_S = 24 * 3600
ROUTER_CALL_S = 10.0  # one request to the router's /workers API
ROUTER_CHANGE_S = 30.0  # a queued change to its list of servers, until it shows
# sglang-router's panic when its Prometheus port is taken (0.3.2): the router exits at start
METRICS_PORT_TAKEN = "failed to install Prometheus metrics exporter"
METRICS_PORT_TRIES = 3
ROUTER_RETRIES = "smg_worker_retries_total"  # its counter of requests it sent again (sglang-router >= 0.3)


def unused_port(host: str) -> int:
    """A port nothing listens on now, as the system hands them out."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_launch_cmd(worker_urls: Sequence[str], cfg: SGLangServer, metrics_port: int,
                      key: str | None = None) -> list[str]:
    """`python -m sglang_router.launch_router ...` in front of `worker_urls`, on host:router_port.
    With a `key` (its fleet's), the router gets it for its own requests to the servers (it forwards a
    client's bearer key with each /generate either way). Its Prometheus exporter gets `metrics_port`
    on the router's host: by default every router takes 29000 on all interfaces, and a second one on
    the machine (another run, another node's trainer) exits at start."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", cfg.host, "--port", str(cfg.router_port), "--policy", cfg.router_policy,
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            "--prometheus-host", cfg.host, "--prometheus-port", str(metrics_port),
            *(["--api-key", key] if key else []), *cfg.router_extra_args]


def start_router(worker_urls: Sequence[str], cfg: SGLangServer, run_dir: str | Path | None,
                 env: dict[str, str] | None = None, key: str | None = None) -> ServerProcess:
    """Launch sglang-router in front of healthy servers and wait until it routes, given `key` (the
    servers' fleet's); stopped on failure."""
    template = cfg.router_launch_cmd or None
    if template is None and importlib.util.find_spec("sglang_router") is None:
        raise UserError("rollout.sglang.router: sglang-router is not installed here (`pip install "
                        "sglang-router`, part of `make install-gpu`); or set rollout.sglang.router_launch_cmd")
    if not port_free(cfg.host, cfg.router_port):
        raise UserError(f"rollout.sglang.router_port: port {cfg.router_port} on {cfg.host} is already in use")
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="rlrecipe-sglang-"))
    attempt = 1
    while True:
        router = _router_process(worker_urls, cfg, run_dir, env, template, key)
        router.start()
        try:
            wait_until_healthy([(router.url, router)], cfg.startup_timeout_s)
            return router
        except UserError:
            router.stop()
            # the Prometheus port, free when chosen, taken before the router bound it: another one
            if template is not None or attempt == METRICS_PORT_TRIES or METRICS_PORT_TAKEN not in router.log_tail(40):
                raise
            attempt += 1
        except BaseException:
            router.stop()
            raise


def _router_process(worker_urls: Sequence[str], cfg: SGLangServer, run_dir: Path, env: dict[str, str] | None,
                    template: list[str] | None, key: str | None) -> ServerProcess:
    """The router's process, not started: the default command with a Prometheus port of its own,
    or the recipe's router_launch_cmd."""
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    metrics_url = None
    if template is None:
        metrics_port = unused_port(cfg.host)
        cmd = router_launch_cmd(worker_urls, cfg, metrics_port, key)
        metrics_url = f"http://{host}:{metrics_port}/metrics"
    else:
        cmd = []
        for part in template:  # "{worker_urls}" stands for one argument per server
            cmd += list(worker_urls) if part == "{worker_urls}" else fill_placeholders(
                [part], host=cfg.host, port=cfg.router_port, policy=cfg.router_policy)
    return ServerProcess(-1, f"http://{host}:{cfg.router_port}", cmd, run_dir / ROUTER_LOG_NAME,
                         env={**os.environ, **key_env(key), **(env or {})}, name="sglang-router",
                         metrics_url=metrics_url, key=key, proof=cfg.ownership_proof)


class RouterWorkers:
    """The router's list of servers, kept to the fleet's live ones that hold the current weights.

    The router health-checks its servers and sends to any that answer, so a server restarted after
    a failure would be sampled with the weights it started from. A server left out is removed from
    the router at once, and added back only once a weight push has reached it. The router's
    /workers API (sglang-router >= 0.3) does both; each change is queued there, so it is waited for.
    """

    def __init__(self, router: ServerProcess, session: Callable[[], requests.Session]):
        self.router, self.session = router, session

    def listed(self) -> dict[str, dict]:
        """The servers the router lists now, by URL."""
        r = self._call("GET", "/workers")
        return {w["url"].rstrip("/"): w for w in r.json().get("workers", [])}

    def wait_for(self, urls: Sequence[str]) -> None:
        """Until the router lists exactly `urls`, healthy."""
        def listed_healthy() -> bool:
            listed = self.listed()
            return set(listed) == set(urls) and all(w.get("is_healthy", False) for w in listed.values())

        self._wait(listed_healthy, f"to list {', '.join(urls)}, healthy")

    def remove(self, url: str) -> None:
        worker = self.listed().get(url)
        if worker is not None:  # the router may have dropped a dead one itself
            self._call("DELETE", f"/workers/{worker['id']}")
        self._wait(lambda: url not in self.listed(), f"to stop listing {url}")

    def add(self, url: str) -> None:
        if url not in self.listed():
            self._call("POST", "/workers", json={"url": url})
        self._wait(lambda: self.listed().get(url, {}).get("is_healthy", False), f"to list {url} as healthy")

    def retries(self) -> float | None:
        """/generate requests the router sent again to another server itself (sglang-router 0.3's
        smg_worker_retries_total): requests cut on a server it hides from the client. None where its
        exporter is unknown (a router_launch_cmd) or does not answer."""
        if self.router.metrics_url is None:
            return None
        # imported here: only a run behind the router reads it (SGLang's own images carry it)
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = self.session().get(self.router.metrics_url, timeout=ROUTER_CALL_S).text
        except requests.RequestException:
            return None
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == ROUTER_RETRIES and sample.labels.get("endpoint") == "generate")

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        try:
            r = self.session().request(method, self.router.url + path, timeout=ROUTER_CALL_S, **kwargs)
        except requests.RequestException as err:
            raise self._error(f"{method} {path} failed: {err}") from None
        if r.status_code >= 300:
            raise self._error(f"{method} {path}: HTTP {r.status_code}: {r.text[:300]} (its /workers API needs "
                              "sglang-router >= 0.3)")
        return r

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + ROUTER_CHANGE_S
        while not done():
            if time.monotonic() > deadline:
                raise self._error(f"did not change within {ROUTER_CHANGE_S:.0f} s: waited {what}")
            time.sleep(0.1)

    def _error(self, what: str) -> UserError:
        return UserError(f"sglang-router ({self.router.url}) {what}; log: {self.router.log_path}")
