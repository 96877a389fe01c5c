"""The SGLang engine against `rlrecipe serve` (SGLang's HTTP API on the CPU engine), over loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.schema import recipe_from_dict
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api import context_length, sglang_sampling_params
from rlrecipe.rollout.sglang.call import apply_answer, to_least_loaded
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.health import probe_health
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory
from tests.helpers import stop_process
from tests.ports import free_port, free_ports, port_free

BOOT_TIMEOUT_S = 90


def rlrecipe_cmd() -> list[str]:
    script = Path(sys.executable).parent / "rlrecipe"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlrecipe.cli.app"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`rlrecipe serve` on a free port, stopped at the end whatever happens."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*rlrecipe_cmd(), "serve", str(tiny_model_dir), "--port", str(port),
                                 "--context-length", "256"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"rlrecipe serve exited: {log_path.read_text()[-2000:]}"
            try:
                if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"rlrecipe serve not up: {log_path.read_text()[-2000:]}"
            time.sleep(0.2)
        yield {"url": url, "proc": proc, "log": log_path}
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def engine(server, tok):
    eng = SGLangEngine([server["url"]], eos_token_id=tok.eos_token_id, max_concurrency=16)
    yield eng
    eng.close()


def prompts(tok, n: int) -> list[Trajectory]:
    return [Trajectory(uid=f"p{i}", group_id=f"g{i // 2}", prompt_ids=tok.encode(f"Add {i * 37} and {10 ** (i % 4)}."))
            for i in range(n)]


def recompute(model, t: Trajectory, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    p = len(t.prompt_ids)
    return lp[p - 1:-1].gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)


def check_consistent(t: Trajectory) -> None:
    assert len(t.response_ids) == len(t.logp_infer) == len(t.versions)


# -- pure mapping ---------------------------------------------------------------------------------
def test_sampling_params_and_response_mapping():
    sp = sglang_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=50), 20, [1])
    assert sp["max_new_tokens"] == 20 and sp["temperature"] == 0.7 and sp["top_p"] == 0.9
    assert sp["top_k"] == -1 and sp["stop_token_ids"] == [1] and sp["ignore_eos"] is False
    assert sglang_sampling_params(SamplingParams(greedy=True, top_k=5), 3, [])["temperature"] == 0.0
    eng = SGLangEngine(["http://127.0.0.1:9"], eos_token_id=1)
    try:
        params = SamplingParams(max_new_tokens=4)
        # the shapes SGLang returns: [logprob, token_id, text|null]; -inf arrives as null
        t = Trajectory(uid="a", prompt_ids=[5])
        apply_answer(eng.fleet, t, {"output_ids": [7, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1},
                                                           "output_token_logprobs": [[-0.5, 7, None], [None, 1, None]]}},
                   params, 3, 0)
        assert t.status == Status.FINISHED and t.response_ids == [7, 1] and t.versions == [3, 3]
        assert t.logp_infer[0] == -0.5 and t.logp_infer[1] < -1e6
        t = Trajectory(uid="b", prompt_ids=[5])
        apply_answer(eng.fleet, t, {"meta_info": {"finish_reason": {"type": "abort", "message": "x"},
                                     "output_token_logprobs": [[-1.0, 9, None]]}}, params, 0, 0)
        assert t.status == Status.RUNNING and t.response_ids == [9]
        apply_answer(eng.fleet, t, {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"}},
                       "output_ids": []}, params, 1, 0)  # aborted while waiting: nothing new
        assert t.status == Status.RUNNING and t.response_ids == [9]
        apply_answer(eng.fleet, t, {"meta_info": {"finish_reason": {"type": "length", "length": 3},
                                     "output_token_logprobs": [[-1.0, 9, None]] * 3}}, params, 1, 0)
        assert t.status == Status.TRUNCATED and t.versions == [0, 1, 1, 1]
    finally:
        eng.close()


def test_one_decision_picks_the_weight_transport():
    from rlrecipe.rollout.weights.transport import WeightTransport, weight_transport

    disk, distributed = SGLangServer(weight_sync="disk"), SGLangServer(weight_sync="distributed")
    assert weight_transport("inprocess", distributed) is WeightTransport.IN_MEMORY
    assert weight_transport("sglang", disk) is WeightTransport.DISK
    assert weight_transport("sglang", distributed) is WeightTransport.BROADCAST
    # the engine follows the same decision: with disk sync it refuses weights in memory
    eng = SGLangEngine(["http://127.0.0.1:9"], eos_token_id=1, cfg=disk)
    try:
        assert eng.transport is WeightTransport.DISK
        with pytest.raises(NotImplementedError, match="weight_sync"):
            eng.update_weights_from_state({}, 1)
    finally:
        eng.close()


# -- against `rlrecipe serve` ---------------------------------------------------------------------
@pytest.mark.slow
def test_server_speaks_the_sglang_api(server, tok):
    url = server["url"]
    info = requests.get(url + "/model_info", timeout=10).json()
    assert info["is_generation"] is True and "model_path" in info
    assert requests.get(url + "/get_model_info", timeout=10).json() == info  # the pre-0.5 name
    assert requests.get(url + "/server_info", timeout=10).json()["context_length"] == 256
    ids = [tok.encode("Add 1 and 2."), tok.encode("Add 30 and 4.")]
    r = requests.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "rid": ["x1", "x2"],
                                              "sampling_params": {"max_new_tokens": 5, "temperature": 0}}, timeout=60)
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 2
    for out, rid in zip(outs, ["x1", "x2"], strict=True):
        meta = out["meta_info"]
        assert meta["id"] == rid and meta["finish_reason"]["type"] in ("stop", "length")
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        assert meta["completion_tokens"] == len(out["output_ids"]) <= 5
    one = requests.post(url + "/generate", json={"text": "Add 1 and 2.", "sampling_params": {"max_new_tokens": 3}},
                        timeout=60).json()
    assert isinstance(one["text"], str) and "output_token_logprobs" not in one["meta_info"]
    bad = requests.post(url + "/generate", json={"input_ids": ids[0], "sampling_params": {"top_k": 0}}, timeout=10)
    assert bad.status_code == 400
    # n parallel samples: a list, prompt by prompt, rids suffixed
    par = requests.post(url + "/generate", json={"input_ids": ids, "rid": "par", "sampling_params": {
        "max_new_tokens": 4, "n": 3}}, timeout=60).json()
    assert [o["meta_info"]["id"] for o in par] == [f"par_{i}_{j}" for i in range(2) for j in range(3)]
    # a stop string ends the output where it first appears, and the text stops before it
    greedy = requests.post(url + "/generate", json={"input_ids": ids[1], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0}}, timeout=60).json()
    text = greedy["text"]
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = requests.post(url + "/generate", json={"input_ids": ids[1], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop": [stop, "never-there"]}}, timeout=60).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.find(stop)]
    assert cut["output_ids"] == greedy["output_ids"][:len(cut["output_ids"])] and len(cut["output_ids"]) < 24
    # ignore_eos: every sample runs to max_new_tokens, eos tokens included
    many = requests.post(url + "/generate", json={"input_ids": ids[0], "sampling_params": {
        "max_new_tokens": 60, "n": 64, "ignore_eos": True}}, timeout=120).json()
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == 60 for o in many)
    assert any(tok.eos_token_id in o["output_ids"] for o in many)  # the untrained model does emit eos
    # streaming: server-sent events, each with the whole output so far; the last is the final answer
    long = {"max_new_tokens": 40, "temperature": 0}
    with requests.post(url + "/generate", json={"input_ids": ids[1], "sampling_params": long, "stream": True},
                       stream=True, timeout=60) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    assert len(outs) >= 2  # the scheduler decodes 16 tokens at a time
    for a, b in zip(outs, outs[1:], strict=False):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"] and a["meta_info"]["finish_reason"] is None
    whole = requests.post(url + "/generate", json={"input_ids": ids[1], "sampling_params": long}, timeout=60).json()
    assert outs[-1]["output_ids"] == whole["output_ids"] and outs[-1]["text"] == whole["text"]
    assert outs[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert requests.post(url + "/abort_request", json={"rid": "nobody"}, timeout=10).status_code == 200
    assert requests.post(url + "/flush_cache", timeout=10).status_code == 200


@pytest.mark.slow
def test_generate_logprobs_match_full_recompute(engine, tok, tiny_model_dir):
    model = load_model(tiny_model_dir)
    for params in (SamplingParams(max_new_tokens=24),
                   SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16)):
        trajs = engine.generate(prompts(tok, 6), params, seed=1)
        assert all(t.done for t in trajs)
        gaps = []
        for t in trajs:
            check_consistent(t)
            assert 0 < len(t.response_ids) <= params.max_new_tokens and set(t.versions) == {0}
            assert t.status == (Status.FINISHED if t.response_ids[-1] == tok.eos_token_id else Status.TRUNCATED)
            gaps.append((recompute(model, t, params.temperature) - torch.tensor(t.logp_infer)).abs())
        assert torch.cat(gaps).max() < 1e-4


# Long enough that the others are still running when the aborts land: one server's aborts come
# about a 16-token chunk after the answer that reaches the budget, a router's two to three.
BUDGETED_NEW_TOKENS = 192


# Calls made before giving up on catching a request in flight: the aborts race the generation, and on a
# loaded machine they can land after every fresh request has finished (all done is not a fault, only a
# call that tested nothing), so a call that left none running is made again with fresh requests.
BUDGETED_TRIES = 3


def _budgeted_call(engine, tok, params: SamplingParams) -> tuple[list[Trajectory], Trajectory]:
    """One trajectory that is nearly done (a forced partial 8 tokens short) among fresh ones, budget 1.

    It finishes within the first chunk; the others are aborted and come back partial. Made again (up to
    BUDGETED_TRIES calls) while none came back running; the last call's trajectories are returned."""
    for _ in range(BUDGETED_TRIES):
        trajs = prompts(tok, 9)
        near = trajs[0]
        filler = tok.encode("0123456789" * 30)[:params.max_new_tokens - 8]
        near.response_ids, near.logp_infer, near.versions = list(filler), [0.0] * len(filler), [0] * len(filler)
        engine.generate(trajs, params, token_budget=1, seed=2)
        if any(t.status == Status.RUNNING for t in trajs):
            break
    return trajs, near


def test_token_budget_aborts_in_flight_and_a_later_call_resumes(engine, tok, tiny_model_dir):
    params = SamplingParams(max_new_tokens=BUDGETED_NEW_TOKENS)
    trajs, near = _budgeted_call(engine, tok, params)
    assert near.done
    running = [t for t in trajs if t.status == Status.RUNNING]
    assert running and any(t.response_ids for t in running)
    for t in trajs:
        check_consistent(t)
        assert len(t.response_ids) <= params.max_new_tokens
    assert all(len(t.response_ids) < params.max_new_tokens for t in running)
    partial = {t.uid: list(t.response_ids) for t in running}
    engine.generate(trajs, params, seed=3)
    assert all(t.done for t in trajs)
    model = load_model(tiny_model_dir)
    for t in running:
        assert t.response_ids[:len(partial[t.uid])] == partial[t.uid]  # appended, not replaced
        check_consistent(t)
        assert (recompute(model, t) - torch.tensor(t.logp_infer)).abs().max() < 1e-4


def test_refill_sends_new_trajectories_within_the_call(engine, tok):
    """`refill` is asked as trajectories finish; what it returns is sent at once, completes in the
    same call, under the engine's version. A refilled prompt that fills the server's context (256
    tokens) ends unsent, and its slot is reported at once."""
    trajs = prompts(tok, 4)
    too_long = Trajectory(uid="long", group_id="gl", prompt_ids=tok.encode("0123456789" * 30)[:256])
    extra = [Trajectory(uid=f"x{i}", group_id="gx", prompt_ids=tok.encode(f"Add {i} and 5.")) for i in range(2)]
    asked: list[int] = []

    def refill(finished: int) -> list[Trajectory]:
        asked.append(finished)
        return {1: [too_long], 2: extra}.get(len(asked), [])

    params = SamplingParams(max_new_tokens=12)
    assert engine.generate(trajs, params, refill=refill) is trajs and len(trajs) == 4
    assert all(t.done for t in trajs + extra)
    assert too_long.status == Status.TRUNCATED and not too_long.response_ids
    assert asked[1] == 1  # the unsent one, reported right after it was handed out
    assert sum(asked) == 7  # each of the seven finished trajectories was reported once
    for t in extra:
        check_consistent(t)
        assert t.response_ids and set(t.versions) == {engine.version}


def test_refilled_groups_go_to_the_least_loaded_live_server():
    """A new group goes where fewest requests are in flight (where rollouts just ended), skipping
    a server left out; its samples stay together. Only the assignment is exercised here."""
    live = [0, 2]  # server 1 is left out
    groups = {"a": 0}
    fresh = [Trajectory(uid=f"{g}{j}", group_id=g, prompt_ids=[1]) for g in ("n", "m") for j in range(2)]
    to_least_loaded(live, fresh, [0, 0, 0, 2], groups)
    # n: server 2 (1 in flight against 3), which then has 3 too; m: the first of the two, server 0
    assert live[groups["n"] % 2] == 2 and live[groups["m"] % 2] == 0 and groups["a"] == 0


def test_weight_update_mid_run(engine, tok, tiny_model_dir, other_model_dir, server):
    params = SamplingParams(max_new_tokens=BUDGETED_NEW_TOKENS)
    trajs, near = _budgeted_call(engine, tok, params)
    running = [t for t in trajs if t.status == Status.RUNNING and t.response_ids]
    assert running
    cut = {t.uid: len(t.response_ids) for t in running}
    try:
        engine.update_weights_from_disk(other_model_dir, 1)
        assert engine.version == 1
        info = requests.get(server["url"] + "/get_model_info", timeout=10).json()
        assert Path(info["model_path"]).resolve() == Path(other_model_dir).resolve() and info["weight_version"] == "1"
        engine.generate(trajs, params, seed=4)
        assert all(t.done for t in trajs)
        old, new = load_model(tiny_model_dir), load_model(other_model_dir)
        for t in running:
            n = cut[t.uid]
            check_consistent(t)
            assert set(t.versions[:n]) == {0} and set(t.versions[n:]) == {1}
            lp = torch.tensor(t.logp_infer)
            assert (recompute(old, t)[:n] - lp[:n]).abs().max() < 1e-4  # sampled under the old weights
            assert (recompute(new, t)[n:] - lp[n:]).abs().max() < 1e-4  # and the rest under the new ones
            assert (recompute(old, t)[n:] - lp[n:]).abs().max() > 1e-3  # the update really changed them
        with pytest.raises(UserError, match="update_weights_from_disk"):
            engine.update_weights_from_disk(Path(other_model_dir) / "missing", 2)
        assert engine.version == 1
    finally:
        engine.update_weights_from_disk(tiny_model_dir, 0)  # the module's server serves the base model again


def test_requests_fit_the_context_and_a_full_context_truncates(engine, tok, server):
    ctx = context_length(engine.fleet.server_info(0))
    assert ctx == 256  # the tiny model's max_position_embeddings, from /server_info
    params = SamplingParams(max_new_tokens=300)
    near, full = prompts(tok, 2)
    # SGLang 0.5.23: an input of max_req_input_len (context - 6) tokens or more is refused, and so is
    # input + new above the context
    max_input = requests.get(server["url"] + "/server_info", timeout=10).json()["max_req_input_len"]
    assert max_input == ctx - 6
    for t, total in ((near, ctx - 8), (full, max_input)):
        filler = tok.encode("0123456789" * 30)[:total - len(t.prompt_ids)]
        t.response_ids, t.logp_infer, t.versions = list(filler), [0.0] * len(filler), [0] * len(filler)
    # the server refuses what cannot fit, as SGLang does ...
    for ids, new, what in ((near.prompt_ids + near.response_ids, 9, "context length"),
                           (full.prompt_ids + full.response_ids, 1, "maximum allowed length")):
        r = requests.post(server["url"] + "/generate", json={"input_ids": ids, "sampling_params":
                                                            {"max_new_tokens": new}}, timeout=30)
        assert r.status_code == 400 and what in r.json()["error"]["message"]
    # ... so the engine asks only for the room left, and does not send a trajectory with none
    before = len(full.response_ids)
    engine.generate([near, full], params, seed=5)
    assert near.num_tokens <= ctx and near.done
    assert full.status == Status.TRUNCATED and len(full.response_ids) == before
    assert full.meta["truncated_by_server"]


def test_requests_follow_the_servers_version(tok):
    """The context edge and sampling_seed as each end of the pin has them (read from SGLang's packages)."""
    from rlrecipe.rollout.sglang.versions import Dialect, dialect_of, parse_version, room

    old, new, unknown = Dialect((0, 5, 1)), Dialect((0, 5, 23)), dialect_of({"version": "custom-build"})
    assert parse_version("0.5.3.post1") == (0, 5, 3) and unknown.version is None
    assert room(old, 256, 250, 200) == 55 and room(new, 256, 250, 200) == 56  # == context: refused before 0.5.11
    assert room(unknown, 256, 250, 200) == 55  # an unknown version gets the stricter edge
    assert room(new, 256, 250, 250) == 0 and room(new, None, None, 10) is None
    assert not old.sampling_seed and Dialect((0, 5, 3)).sampling_seed and unknown.sampling_seed
    assert not old.weight_update_session and not Dialect((0, 5, 20)).weight_update_session
    assert Dialect((0, 5, 21)).weight_update_session and not Dialect((0, 5, 2)).destroy_group


def test_weights_changed_behind_the_engine_are_detected(engine, tok, tiny_model_dir, server):
    try:
        engine.update_weights_from_disk(tiny_model_dir, 5)
        engine.generate(prompts(tok, 2), SamplingParams(max_new_tokens=4), seed=1)  # version "5": fine
        r = requests.post(server["url"] + "/update_weights_from_disk",
                          json={"model_path": str(tiny_model_dir), "weight_version": "7"}, timeout=60)
        assert r.json()["success"]
        with pytest.raises(UserError, match="weight_version '7'.*last set '5'"):
            engine.generate(prompts(tok, 2), SamplingParams(max_new_tokens=4), seed=1)
    finally:
        engine.update_weights_from_disk(tiny_model_dir, 0)


def test_distributed_weight_sync_broadcasts_into_the_server(server, tok, tiny_model_dir, other_model_dir):
    """weight_sync: distributed, over gloo: the engine is rank 0 of a group with the server."""
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port())
    eng = SGLangEngine([server["url"]], eos_token_id=tok.eos_token_id, max_concurrency=16, cfg=cfg)
    base, other = load_model(tiny_model_dir), load_model(other_model_dir)
    try:
        for model, version in ((other, 2), (base, 3)):  # the second update reuses the group
            eng.update_weights_from_state(model.state_dict(), version)
            assert eng.model_info(0)["weight_version"] == str(version)
            trajs = eng.generate(prompts(tok, 4), SamplingParams(max_new_tokens=16), seed=1)
            lp = torch.cat([torch.tensor(t.logp_infer) for t in trajs])
            assert all(set(t.versions) == {version} for t in trajs)
            assert (torch.cat([recompute(model, t) for t in trajs]) - lp).abs().max() < 1e-4
            wrong = base if model is other else other
            assert (torch.cat([recompute(wrong, t) for t in trajs]) - lp).abs().max() > 1e-3
        # the server refuses a tensor it has no place for, at once and by name; the group is dropped
        with pytest.raises(UserError, match="not_a_weight"):
            eng.update_weights_from_state({"not_a_weight": torch.zeros(3)}, 9)
        assert eng.weights.broadcast.group is None and eng.version == 3
        # the failed push closed its weight-update session (SGLang 0.5.21 on): the next one opens it again
        eng.update_weights_from_state(base.state_dict(), 4)  # the module's server keeps the base weights
        assert eng.model_info(0)["weight_version"] == "4"
        r = requests.post(server["url"] + "/end_weight_update", json={}, timeout=10)
        assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
    finally:
        eng.close()


def test_a_weight_update_session_left_open_is_closed_and_the_push_goes_through(server, tok, tiny_model_dir, capsys):
    """A client killed between /begin_weight_update and /end_weight_update leaves the session open
    (SGLang 0.5.21 on): every later begin is a 400 until an end closes it. The next push closes it
    and opens its own."""
    url = server["url"]
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port())
    eng = SGLangEngine([url], eos_token_id=tok.eos_token_id, max_concurrency=16, cfg=cfg)
    try:
        assert requests.post(url + "/begin_weight_update", json={}, timeout=10).status_code == 200  # the killed push's
        r = requests.post(url + "/begin_weight_update", json={}, timeout=10)
        assert r.status_code == 400 and "already open" in r.json()["message"]
        eng.update_weights_from_state(load_model(tiny_model_dir).state_dict(), 5)  # the base weights again
        assert eng.model_info(0)["weight_version"] == "5"
        assert f"SGLang server {url} had a weight-update session left open" in capsys.readouterr().err
        # and the push closed its own
        r = requests.post(url + "/end_weight_update", json={}, timeout=10)
        assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
    finally:
        requests.post(url + "/end_weight_update", json={}, timeout=10)  # the module's server left with none open
        eng.close()


class ScriptedServers:
    """`LiveServers` whose /begin_weight_update and /end_weight_update answer from a script, in order."""

    def __init__(self, answers: list[tuple[int, str]]):
        from rlrecipe.rollout.sglang.versions import Dialect

        self.cfg, self.urls, self.live = SGLangServer(), ["http://s0"], [0]
        self.answers, self.asked = answers, []
        self._dialect = Dialect((0, 5, 23))

    def dialect(self, i):
        return self._dialect

    def post(self, i, path, body, timeout=30.0):
        self.asked.append(path)
        code, message = self.answers.pop(0)
        r = requests.Response()
        r.status_code, r._content = code, json.dumps({"success": code == 200, "message": message}).encode()
        return r


def test_only_a_session_left_open_is_closed_and_begun_again_and_only_once():
    from rlrecipe.rollout.sglang.broadcast import WeightBroadcast

    left_open = (400, "a weight-update session is already open; call end_weight_update() first")  # SGLang 0.5.23's
    srv = ScriptedServers([left_open, (200, "Success"), (200, "Success")])
    assert WeightBroadcast(srv)._session("begin", [0]) == [0]
    assert srv.asked == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    # still open after the end: an error, not a second round
    srv = ScriptedServers([left_open, (200, "Success"), left_open])
    with pytest.raises(UserError, match="/begin_weight_update failed: a weight-update session is already open"):
        WeightBroadcast(srv)._session("begin", [0])
    assert srv.asked == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    # any other refusal stays an error, and no session is closed for it
    srv = ScriptedServers([(400, "weight update is not supported")])
    with pytest.raises(UserError, match="not supported"):
        WeightBroadcast(srv)._session("begin", [0])
    assert srv.asked == ["/begin_weight_update"]


def test_weight_buckets_and_tied_tensors():
    from rlrecipe.modeling import distinct_tensors
    from rlrecipe.rollout.weights.sync import buckets

    emb = torch.zeros(4, 8)
    state = {"embed": emb, "a": torch.zeros(10), "lm_head": emb, "b": torch.zeros(31), "c": torch.zeros(2)}
    named = distinct_tensors(state)
    assert [n for n, _ in named] == ["embed", "a", "b", "c"]  # the tied lm_head is sent once
    # 4-byte floats, at most 160 bytes a bucket: embed (128) | a (40) | b (124) + c (8)
    assert [[n for n, _ in b] for b in buckets(named, 160)] == [["embed"], ["a"], ["b", "c"]]


def test_factory_attaches_to_urls(server, tiny_model_dir, tok):
    from rlrecipe.rollout.factory import make_rollout_engine

    recipe = recipe_from_dict({"run": {"name": "t"}, "model": {"path": str(tiny_model_dir)},
                               "rollout": {"engine": "sglang", "urls": [server["url"]]}})
    eng = make_rollout_engine(recipe, tiny_model_dir, tok, version=5)
    try:
        assert isinstance(eng, SGLangEngine) and eng.version == 5 and not eng.servers
        [t] = eng.generate(prompts(tok, 1), SamplingParams(max_new_tokens=4))
        assert t.done and set(t.versions) == {5}
    finally:
        eng.close()


def test_attaching_with_another_model_dir_loads_it(server, tiny_model_dir, other_model_dir, tok):
    """`rlrecipe eval --model X` on attached servers must sample from X, whatever they served before."""
    from rlrecipe.rollout.factory import make_rollout_engine

    recipe = recipe_from_dict({"run": {"name": "t"}, "model": {"path": str(tiny_model_dir)},
                               "rollout": {"engine": "sglang", "urls": [server["url"]]}})
    eng = make_rollout_engine(recipe, other_model_dir, tok)
    try:
        info = requests.get(server["url"] + "/get_model_info", timeout=10).json()
        assert Path(info["model_path"]).resolve() == Path(other_model_dir).resolve()
    finally:
        eng.update_weights_from_disk(tiny_model_dir, 0)
        eng.close()


def test_unreachable_attached_server_is_a_clear_error(tok):
    eng = SGLangEngine([f"http://127.0.0.1:{free_port()}"], eos_token_id=tok.eos_token_id)
    try:
        with pytest.raises(UserError, match="unreachable|failed"):
            eng.generate(prompts(tok, 2), SamplingParams(max_new_tokens=4))
    finally:
        eng.close()


# -- lifecycle: the engine launches and stops its servers ------------------------------------------
@pytest.mark.slow
def test_launch_rlrecipe_serve_logs_and_close(tiny_model_dir, tok, tmp_path):
    base = free_ports(1)
    cfg = SGLangServer(base_port=base, startup_timeout_s=BOOT_TIMEOUT_S,
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}",
                                   "--dtype", "{dtype}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    proc = eng.servers[0].proc
    log = tmp_path / "sglang_server_0.log"
    try:
        assert eng.urls == [f"http://127.0.0.1:{base}"] and proc.poll() is None
        assert "ready on" in log.read_text()
        trajs = eng.generate(prompts(tok, 4), SamplingParams(max_new_tokens=6))
        assert all(t.done for t in trajs)
    finally:
        eng.close()
    assert proc.poll() is not None
    assert "shutting down" in log.read_text()  # stopped with SIGTERM, cleanly
    assert port_free(base)


@pytest.mark.slow
def test_broadcast_sync_reaches_two_servers(tiny_model_dir, other_model_dir, tok, tmp_path):
    """Two servers in one weight update group (ranks 1 and 2 after the trainer's 0)."""
    base = free_ports(2)
    cfg = SGLangServer(base_port=base, num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S, weight_sync="distributed",
                       weight_sync_backend="gloo", weight_sync_port=free_port(),
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}",
                                   "--dtype", "{dtype}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    try:
        other = load_model(other_model_dir)
        eng.update_weights_from_state(other.state_dict(), 1)
        trajs = eng.generate(prompts(tok, 8), SamplingParams(max_new_tokens=12), seed=1)  # 4 groups, 2 servers
        assert (torch.cat([recompute(other, t) - torch.tensor(t.logp_infer) for t in trajs])).abs().max() < 1e-4
        for i in range(2):
            assert f"as rank {i + 1} of 3" in (tmp_path / f"sglang_server_{i}.log").read_text()
            assert eng.model_info(i)["weight_version"] == "1"
    finally:
        eng.close()


@pytest.mark.slow
def test_a_restarted_server_rejoins_the_broadcast_group_with_the_current_weights(tiny_model_dir, other_model_dir,
                                                                                tok, tmp_path):
    """weight_sync distributed, retry_on_other_servers, max_restarts 1: server 1 dies and is started
    again (with the weights it was launched with); the next push makes the group again with it
    (rank 2 of 3 once more) and it samples with that push's weights, not its own."""
    base = free_ports(2)
    cfg = SGLangServer(base_port=base, num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S, weight_sync="distributed",
                       weight_sync_backend="gloo", weight_sync_port=free_port(), retry_on_other_servers=True,
                       max_restarts=1, launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}",
                                                   "--port", "{port}", "--dtype", "{dtype}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path,
                              eos_token_id=tok.eos_token_id)
    try:
        other = load_model(other_model_dir)
        eng.update_weights_from_state(other.state_dict(), 1)
        first = eng.servers[1].proc.pid
        eng.servers[1].proc.kill()
        eng.servers[1].proc.wait(timeout=30)
        trajs = eng.generate(prompts(tok, 8), SamplingParams(max_new_tokens=6), seed=1)
        assert all(t.done for t in trajs) and eng.live == [0]
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not (eng.servers[1].alive() and eng.servers[1].proc.pid != first and probe_health(eng.urls[1], 10) is None):
            assert time.monotonic() < deadline, "server 1 was not started again"
            time.sleep(0.5)
        moved = {k: v * 1.05 for k, v in other.state_dict().items()}
        eng.update_weights_from_state(moved, 2)
        assert eng.live == [0, 1]
        log = (tmp_path / "sglang_server_1.log").read_text()
        assert log.count("as rank 2 of 3") == 2  # joined at launch, and again once taken back
        pushed = load_model(other_model_dir)
        pushed.load_state_dict(moved)
        trajs = eng.generate(prompts(tok, 8), SamplingParams(max_new_tokens=6), seed=2)  # 4 groups over both
        assert eng.model_info(1)["weight_version"] == "2"
        assert (torch.cat([recompute(pushed, t) - torch.tensor(t.logp_infer) for t in trajs])).abs().max() < 1e-4
    finally:
        eng.close()


# A stand-in server with no model: token = port % 1000; max_new_tokens 999 hangs (to be killed).
FAKE_SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[1])
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({"model_path": "fake"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/generate":
            if body["sampling_params"]["max_new_tokens"] == 999:
                time.sleep(120)
            tok = port % 1000
            self._send({"output_ids": [tok], "meta_info": {"id": body["rid"], "finish_reason": {"type": "length"},
                                                           "output_token_logprobs": [[-1.5, tok, None]]}})
        else:
            self._send({"success": True})
print("fake sglang listening", flush=True)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_two_servers_share_groups_and_a_crash_names_its_log(tmp_path, tiny_model_dir):
    import threading

    base = free_ports(2)
    cfg = SGLangServer(base_port=base, num_servers=2, startup_timeout_s=30,
                       launch_cmd=[sys.executable, "-c", FAKE_SERVER, "{port}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, run_dir=tmp_path, eos_token_id=1, version=7)
    procs = [s.proc for s in eng.servers]
    try:
        trajs = [Trajectory(uid=f"{g}-{j}", group_id=str(g), prompt_ids=[5, 6]) for g in range(4) for j in range(2)]
        eng.generate(trajs, SamplingParams(max_new_tokens=1))
        # a group's samples share a server; groups alternate between the two
        assert [t.response_ids[0] for t in trajs] == [(base + g % 2) % 1000 for g in range(4) for _ in range(2)]
        assert all(t.status == Status.TRUNCATED and t.versions == [7] and t.logp_infer == [-1.5] for t in trajs)
        killer = threading.Timer(0.5, os.kill, (procs[1].pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(UserError) as err:  # the server dies while requests are in flight
            eng.generate([Trajectory(uid=str(g), group_id=str(g), prompt_ids=[5]) for g in range(4)],
                         SamplingParams(max_new_tokens=999))
        killer.join()
        assert "server 1" in str(err.value) and str(tmp_path / "sglang_server_1.log") in str(err.value)
        assert "fake sglang listening" in str(err.value)  # the log's last line
        assert time.monotonic() - t0 < 15
    finally:
        eng.close()
    assert all(p.poll() is not None for p in procs)


def test_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path, tiny_model_dir):
    cfg = SGLangServer(base_port=free_port(), startup_timeout_s=30,
                       launch_cmd=[sys.executable, "-c", "import sys; print('CUDA error: no device'); sys.exit(3)"])
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        SGLangEngine.launch(tiny_model_dir, cfg=cfg, run_dir=tmp_path)
    msg = str(err.value)
    assert "code 3" in msg and "CUDA error: no device" in msg and str(tmp_path / "sglang_server_0.log") in msg
    assert time.monotonic() - t0 < 20


def test_busy_port_and_missing_sglang_are_user_errors(tmp_path, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = SGLangServer(base_port=s.getsockname()[1], launch_cmd=["true"])
        with pytest.raises(UserError, match="already in use"):
            SGLangEngine.launch(tiny_model_dir, cfg=cfg, run_dir=tmp_path)
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(UserError, match="SGLang is not installed"):
            SGLangEngine.launch(tiny_model_dir, cfg=SGLangServer(base_port=free_port()), run_dir=tmp_path)


def test_without_a_stated_context_the_client_keeps_to_the_input_limit(tiny_model_dir):
    """SGLang launched without --context-length states context_length null in /server_info (so does
    `rlrecipe serve`); the client then keeps input + new tokens to max_req_input_len + 1."""
    from tests.helpers import serving_in_thread

    with serving_in_thread(tiny_model_dir) as (port, _):
        url = f"http://127.0.0.1:{port}"
        served = requests.get(url + "/server_info", timeout=10).json()
        assert (served["context_length"], served["max_req_input_len"]) == (None, 250)
        assert context_length(SGLangEngine([url]).fleet.server_info(0)) == 251
