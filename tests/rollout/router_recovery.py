"""One scenario, run on `rlrecipe serve` servers (tests/rollout/test_router_recovery.py) and on the
released SGLang (tests/live/test_live_router.py): two servers behind the real sglang-router, one
killed while requests are in flight on it, started again, and taken back only once a push gave it
the current weights."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import requests
import torch

from rlrecipe.rollout.sglang.api_key import auth_headers
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory

RESTART_WAIT_S = 240
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log


def router_lists(eng) -> dict[str, bool]:
    """The servers the router lists, URL -> is_healthy."""
    r = requests.get(eng.router.url + "/workers", headers=auth_headers(eng.fleet.key), timeout=10)
    r.raise_for_status()
    return {w["url"].rstrip("/"): w["is_healthy"] for w in r.json()["workers"]}


def generations_started(eng) -> int:
    """/generate requests the router has begun (its log names each)."""
    text = ANSI.sub("", eng.router.log_path.read_text(errors="replace"))
    return sum("uri=/generate" in line and "started processing request" in line for line in text.splitlines())


def cut_on(eng, url: str) -> int:
    """/generate requests the router could not complete on the server at `url` (its log names each)."""
    text = ANSI.sub("", eng.router.log_path.read_text(errors="replace"))
    return sum("Failed to send" in line and f"worker_url={url} route=/generate" in line for line in text.splitlines())


def kill_when_busy(eng, server: int, started_before: int, at_least: int) -> threading.Thread:
    """SIGKILL server `server`'s process group once the router has begun `at_least` more generations."""
    def kill():
        deadline = time.monotonic() + 120
        while generations_started(eng) < started_before + at_least and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(eng.servers[server].proc.pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def wait_until_answers(url: str) -> None:
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer after its restart within {RESTART_WAIT_S} s")


def killed_and_restarted_behind_the_router(eng, prompts: list[Trajectory], new_tokens: int, recompute,
                                           base, other, push_other) -> None:
    """`eng`: two launched servers behind the router, retry_on_other_servers, max_restarts 1, serving
    `base` (a model) as their current version. `recompute(model, traj)` is the trainer's log-probs;
    `push_other()` pushes the weights of `other` as the next version."""
    now = eng.fleet.version
    url0, url1 = eng.urls
    assert router_lists(eng) == {url0: True, url1: True}
    params = SamplingParams(max_new_tokens=new_tokens)
    killer = kill_when_busy(eng, 1, generations_started(eng), at_least=len(prompts) // 2)
    trajs = eng.generate(prompts, params, seed=1)
    killer.join()
    # requests were cut on the killed server, and every one finished all the same: sent again by the
    # router (its retries) or by the client (the router answered an error)
    cut = cut_on(eng, url1)
    assert cut >= 1
    # each one counted where it was sent again: by the router (its exporter) or by the client
    metrics = eng.fleet_metrics()
    assert metrics["rollout_router_retries"] + metrics["rollout_requests_resent"] >= cut
    assert all(t.status != Status.RUNNING for t in trajs)
    for t in trajs:
        assert len(t.response_ids) == len(t.logp_infer) and set(t.versions) == {now}
        assert (recompute(base, t) - torch.tensor(t.logp_infer)).abs().max() < 1e-4
    assert eng.live == [0] and 1 in eng.fleet.failed
    assert router_lists(eng) == {url0: True}  # off the router's list at once

    # it is started again and answers, with the weights it started from: the router must not see it
    wait_until_answers(url1)
    assert router_lists(eng) == {url0: True}
    more = eng.generate([Trajectory(uid=f"m{i}", prompt_ids=t.prompt_ids) for i, t in enumerate(prompts[:4])],
                        params, seed=2)
    assert all(set(t.versions) == {now} for t in more)

    # the next push takes it back with the current weights, and only then does the router list it
    push_other()
    assert eng.live == [0, 1] and router_lists(eng) == {url0: True, url1: True}
    for url in eng.urls:
        info = requests.get(url + "/model_info", headers=auth_headers(eng.fleet.key), timeout=10).json()
        assert info["weight_version"] == str(now + 1)
    after = eng.generate([Trajectory(uid=f"a{i}", prompt_ids=t.prompt_ids) for i, t in enumerate(prompts)],
                         params, seed=3)
    for t in after:
        assert set(t.versions) == {now + 1}
        assert (recompute(other, t) - torch.tensor(t.logp_infer)).abs().max() < 1e-4
    assert eng.fleet_metrics()["rollout_server_restarts"] == 1.0
