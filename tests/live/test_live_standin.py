"""`rlrecipe serve` against the released SGLang: the same requests to both, on the same model, for
every endpoint the client uses; status codes, response fields and (where both compute them) the
numbers must agree. Where they differ, the stand-in is what changes."""

from __future__ import annotations

import pytest
import requests

# what the client reads of /server_info (rollout/sglang/fleet.py, sglang/versions.py, weights/check.py)
SERVER_INFO_READ = ("version", "device", "dtype", "context_length", "max_req_input_len", "tp_size", "dp_size")
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _both(sglang_server, standin_server, method: str, path: str, body=None):
    real = requests.request(method, sglang_server.url + path, json=body, timeout=120)
    ours = requests.request(method, standin_server.url + path, json=body, timeout=120)
    return real, ours


def _json(r):
    try:
        return r.json()
    except ValueError:
        return r.text


def _shape(value):
    """A JSON value's structure: dicts by key, lists by their first element, leaves by kind."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return "number" if isinstance(value, int | float) and not isinstance(value, bool) else type(value).__name__


def _within(ours, real, path: str = "") -> list[str]:
    """Where `ours` has a field `real` lacks, or a field of another structure (its extra fields are fine)."""
    if isinstance(ours, dict) and isinstance(real, dict):
        out = [f"{path}.{k}: not in SGLang's answer" for k in ours if k not in real]
        return out + [p for k in ours if k in real for p in _within(ours[k], real[k], f"{path}.{k}")]
    if isinstance(ours, list) and isinstance(real, list):
        return _within(ours[0], real[0], path + "[0]") if ours and real else []
    # null where SGLang has a value (or the reverse) is the same field; NoneType vs str is kept apart
    return [] if ours == real or "NoneType" in (ours, real) else [f"{path}: {ours} where SGLang has {real}"]


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/health", None),
    ("GET", "/health_generate", None),
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/server_info", None),
    ("GET", "/no_such_route", None),
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
    ("POST", "/generate", {"input_ids": [PROMPT, PROMPT[:3]], "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
    ("POST", "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                           "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9}}),
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "no_such_key": 1}}),
    ("POST", "/generate", {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 3}}),
    ("POST", "/generate", {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 200}}),
    ("POST", "/abort_request", {"rid": "no-such-request"}),
    ("GET", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2}),
    ("POST", "/end_weight_update", {}),
    ("POST", "/destroy_weights_update_group", {"group_name": "no-such-group"}),
    ("POST", "/update_weights_from_disk", {"model_path": "/no/such/model"}),
    ("POST", "/flush_cache", None),
])
def test_the_stand_in_answers_as_sglang(sglang_server, standin_server, method, path, body):
    real, ours = _both(sglang_server, standin_server, method, path, body)
    assert ours.status_code == real.status_code, (_json(real), _json(ours))
    if path == "/flush_cache" or path == "/health" or path == "/health_generate":
        return  # plain text or nothing
    assert _within(_shape(_json(ours)), _shape(_json(real))) == [], (_json(real), _json(ours))
    if path == "/server_info":
        assert {k: ours.json()[k] for k in SERVER_INFO_READ} == {k: real.json()[k] for k in SERVER_INFO_READ}
    if "no_such_key" in str(body):
        assert ours.json() == real.json()


def test_a_weight_update_session_opens_and_closes_alike(sglang_server, standin_server):
    answers = [_both(sglang_server, standin_server, "POST", p, {}) for p in
               ("/begin_weight_update", "/begin_weight_update", "/end_weight_update", "/end_weight_update")]
    assert [(r.status_code, o.status_code) for r, o in answers] == [(200, 200), (400, 400), (200, 200), (400, 400)]
    assert [o.json() for _, o in answers] == [r.json() for r, _ in answers]


def test_a_disk_update_answers_alike_and_moves_the_weight_version(sglang_server, standin_server, demo_model_dir):
    body = {"model_path": str(demo_model_dir), "weight_version": "7"}
    real, ours = _both(sglang_server, standin_server, "POST", "/update_weights_from_disk", body)
    assert (real.status_code, ours.status_code) == (200, 200)
    assert set(ours.json()) == set(real.json()) and ours.json()["success"] and real.json()["success"]
    got = [requests.get(s.url + "/model_info", timeout=30).json()["weight_version"]
           for s in (sglang_server, standin_server)]
    assert got == ["7", "7"]
    for s in (sglang_server, standin_server):  # as the other tests found it
        requests.post(s.url + "/update_weights_from_disk", json={**body, "weight_version": "default"}, timeout=120)


def test_the_same_weights_give_the_same_numbers(sglang_server, standin_server):
    """Greedy tokens, input log-probs at a temperature other than 1 (raw logits on both) and output
    log-probs (tempered on both), and the /weights_checker checksums of every tensor named alike."""
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    real, ours = (r.json() for r in _both(sglang_server, standin_server, "POST", "/generate", body))
    assert ours["output_ids"] == real["output_ids"]
    body = {"input_ids": PROMPT + real["output_ids"], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.5}}
    real, ours = (r.json()["meta_info"] for r in _both(sglang_server, standin_server, "POST", "/generate", body))
    pairs = list(zip(ours["input_token_logprobs"], real["input_token_logprobs"], strict=True))
    assert pairs[0][0][0] is None and pairs[0][1][0] is None
    assert max(abs(o[0] - r[0]) for o, r in pairs[1:]) < 1e-4 and [o[1] for o, _ in pairs] == [r[1] for _, r in pairs]

    real, ours = (r.json()["ranks"][0]["checksums"]
                  for r in _both(sglang_server, standin_server, "POST", "/weights_checker", {"action": "checksum"}))
    common = sorted(set(real) & set(ours))
    # the embedding (padded by SGLang to 320 rows), every norm, o_proj and down_proj: fused ones differ by name
    assert "model.embed_tokens.weight" in common and len(common) >= 12, common
    assert {n: ours[n] for n in common} == {n: real[n] for n in common}
