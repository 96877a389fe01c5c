"""The wait for SGLang servers to come up: GET /health_generate until each answers 200.

Before the first request, every server (and the router) is polled on GET /health_generate, each
probe bounded by the time left of `startup_timeout_s`; one that exits or never answers 200 stops
the run with an error naming it and its log. A launched server is checked for its port and, once it
answers, proves it is the run's own (sglang/ownership.py) before anything else is sent to it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import requests

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.rollout.sglang.api_key import anonymous_headers

if TYPE_CHECKING:
    from rlrecipe.rollout.sglang.server import ServerProcess

HEALTH_PATH = "/health_generate"  # SGLang answers it once a one-token generation went through
PROBE_TIMEOUT_S = 30.0  # one health probe at most (SGLang gives up on its own after 20 s)
WAIT_NOTICE_S = 10.0  # say what is awaited once a start-up takes this long


def probe_health(url: str, time_left: float) -> str | None:
    """None when `url` answers GET /health_generate with 200 within the time left, else what it did.
    Sent without the key: it may reach a process that took a launched server's port after its
    check, and health paths need no key (SGLang, `rlrecipe serve`)."""
    try:
        r = requests.get(url + HEALTH_PATH, headers=anonymous_headers(),
                         timeout=(min(5.0, time_left), min(PROBE_TIMEOUT_S, time_left)))
    except requests.RequestException as err:
        return type(err).__name__
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def wait_until_healthy(servers: Sequence[tuple[str, ServerProcess | None]], timeout: float) -> None:
    """Until every (url, its process or None when attached) answers /health_generate with 200.

    Probes run side by side, each bounded by the time left, so a server that accepts connections
    and never answers costs `timeout`, not one probe timeout per server. A launched server that
    exits fails at once with its exit code and log; one not healthy by the deadline fails with an
    error naming it (and its log). A launched server's port held by another process fails at once,
    before that process is probed, and a launched server that answers proves it is ours
    (sglang/ownership.py)."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    last: dict[str, str] = {}
    noticed = False
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(pending)))) as pool:
        while pending:
            for _, proc in pending:
                if proc is not None and proc.proc is not None:
                    proc.check_port()  # first: a server that lost its port exits for that reason
                    if not proc.alive():
                        raise proc.crash_error("exited during start-up")
            left = deadline - time.monotonic()
            if left <= 0:
                url, proc = pending[0]
                name = f"{proc.label} ({url})" if proc is not None else f"SGLang server {url}"
                where = f"; log: {proc.log_path}" if proc is not None else ""
                raise UserError(f"{name} not healthy after {timeout:.0f}s (last: {last.get(url, '?')}; raise "
                                f"rollout.sglang.startup_timeout_s?){where}")
            answers = list(pool.map(lambda entry, left=left: probe_health(entry[0], left), pending))
            for (url, proc), answer in zip(pending, answers, strict=True):
                if answer is not None:
                    last[url] = answer
                elif proc is not None and proc.proc is not None:
                    proc.prove_ours()
            pending = [entry for entry, answer in zip(pending, answers, strict=True) if answer is not None]
            if pending and not noticed and time.monotonic() > deadline - timeout + WAIT_NOTICE_S:
                noticed = True
                console.print(f"waiting for {len(pending)} SGLang server(s) to answer {HEALTH_PATH}, "
                              f"up to {timeout:.0f}s in all (first: {pending[0][0]})")
            if pending:
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
