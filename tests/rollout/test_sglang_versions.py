"""The client against a server that answers as the oldest SGLang of the pin (0.5.1): `rlrecipe serve` with
RLRECIPE_SERVE_SGLANG=0.5.1 has no weight-update session, no /destroy_weights_update_group, no
/weights_checker, no sampling_seed (HTTP 500, as SGLang's TypeError) and refuses input + new = context."""

from __future__ import annotations

import os
import subprocess

import pytest
import requests
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.base import SEED_KEY
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.weights.probe import Scores, judge_scores, probe_sequences
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.rollout.test_sglang_client import BOOT_TIMEOUT_S, free_port, rlrecipe_cmd, stop_process


@pytest.fixture(scope="module")
def old_server(tiny_model_dir, tmp_path_factory):
    import time

    port = free_port()
    log_path = tmp_path_factory.mktemp("old") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*rlrecipe_cmd(), "serve", str(tiny_model_dir), "--port", str(port)],
                                env={**os.environ, "RLRECIPE_SERVE_SGLANG": "0.5.1"}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_the_old_server_answers_as_0_5_1(old_server):
    assert requests.get(old_server + "/server_info", timeout=10).json()["version"] == "0.5.1"
    for path in ("/begin_weight_update", "/weights_checker", "/destroy_weights_update_group"):
        assert requests.post(old_server + path, json={}, timeout=10).status_code == 404
    r = requests.post(old_server + "/generate", json={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "sampling_seed": 3}}, timeout=30)
    assert r.status_code == 500 and "sampling_seed" in r.text


def test_the_engine_sends_an_old_server_only_what_it_accepts(old_server, tok, tiny_model_dir, other_model_dir):
    """No sampling_seed, one token short of the context, broadcasts without a session, and the group
    made again under a new name (0.5.1 cannot destroy the old one)."""
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port())
    eng = SGLangEngine([old_server], eos_token_id=tok.eos_token_id, cfg=cfg, served_dtype="float32")
    try:
        trajs = [Trajectory(uid=f"s{i}", group_id="g", prompt_ids=tok.encode("Add 2 and 3."), meta={SEED_KEY: i})
                 for i in range(2)]
        eng.generate(trajs, SamplingParams(max_new_tokens=6))
        assert all(t.done and t.response_ids for t in trajs)
        # 240 tokens < max_req_input_len 250; 0.5.1 refuses input + new = 256, so 15 new at most
        near = Trajectory(uid="n", prompt_ids=tok.encode("0123456789" * 30)[:240])
        eng.generate([near], SamplingParams(max_new_tokens=100, greedy=True))
        assert near.num_tokens <= 255 and near.done
        for model, version in ((other_model_dir, 1), (tiny_model_dir, 2)):
            eng.update_weights_from_state(load_model(model).state_dict(), version)
            assert eng.model_info(0)["weight_version"] == str(version)
        eng.weights.broadcast.members_changed()  # as after a server left out and taken back
        eng.update_weights_from_state(load_model(other_model_dir).state_dict(), 3)
        assert eng.weights.broadcast.group_name == "weight_update_group_1"
    finally:
        eng.close()


def test_without_checksums_the_probe_tells_new_weights_from_old(old_server, tok, tiny_model_dir, other_model_dir,
                                                               capfd):
    """Qwen2 on 0.5.1: neither /weights_checker nor /get_weights_by_name. The trainer's log-probs of the
    probe under the pushed and the previous weights decide; the server's input_token_logprobs are SGLang's."""
    from rlrecipe.rollout.weights.check import WeightMismatch

    seqs = probe_sequences(tok)
    assert len(seqs) == 4 and all(2 <= len(s) <= 32 for s in seqs)

    def scores(model_dir, version):
        model = load_model(model_dir)
        lps = []
        for s in seqs:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), -1)
            lps.append(logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0].tolist())
        return Scores(version, seqs, lps)

    eng = SGLangEngine([old_server], eos_token_id=tok.eos_token_id, served_dtype="float32")
    try:
        eng.expect_logprobs(scores(tiny_model_dir, 0))  # what the server starts with
        eng.expect_logprobs(scores(other_model_dir, 1))
        capfd.readouterr()
        eng.update_weights_from_disk(other_model_dir, 1)  # decided by the probe: no exception, no line
        assert "cannot be verified" not in capfd.readouterr().err
        eng.expect_logprobs(scores(tiny_model_dir, 2))
        # the server is told to load version 2 but is given version 1's files again: it keeps version 1's
        with pytest.raises(WeightMismatch) as err:
            eng.update_weights_from_disk(other_model_dir, 2)
        msg = str(err.value)
        assert msg.startswith(f"SGLang server {old_server}: after the update to weight version 2, it still serves "
                              "the weights of version 1 (its log-probs of the probe are ")
    finally:
        eng.close()


def test_the_probe_decides_only_past_the_noise():
    new, prev = Scores(2, [[1, 2, 3]], [[-1.0, -2.0]]), Scores(1, [[1, 2, 3]], [[-1.2, -2.2]])
    assert judge_scores([[-1.01, -1.99]], new, prev)[0] == "ok"
    assert judge_scores([[-1.19, -2.21]], new, prev)[0] == "stale"
    assert judge_scores([[-1.1, -2.1]], new, prev)[0] == "undecided"  # halfway: not measurably closer
    assert judge_scores([[-5.0, -6.0]], new, prev)[0] == "wrong"
    assert judge_scores([[-1.0, -2.0]], new, None)[0] == "undecided"
    assert judge_scores([[-3.0, -2.0]], new, None)[0] == "wrong"
    tiny_step = Scores(1, [[1, 2, 3]], [[-1.0001, -2.0001]])
    verdict, detail = judge_scores([[-1.02, -1.98]], new, tiny_step)  # bf16 noise beyond what the step moved
    assert verdict == "undecided" and "the push moved them by 0.0001" in detail


def test_rules_of_a_version_outside_the_pin_are_refused_in_one_line(monkeypatch, tiny_model_dir):
    from rlrecipe.core.errors import UserError
    from rlrecipe.serve.http_server import make_server

    monkeypatch.setenv("RLRECIPE_SERVE_SGLANG", "0.4.9")
    with pytest.raises(UserError) as err:
        make_server(tiny_model_dir, port=0)
    assert str(err.value) == "RLRECIPE_SERVE_SGLANG='0.4.9': expected an SGLang version from 0.5.1 to 0.5.23"
