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


def test_the_lora_endpoints_answer_alike(sglang_lora_server, standin_lora_server, demo_model_dir, tmp_path):
    """Both launched with the same LoRA flags: loads from tensors and from disk, their refusals, /generate
    under an adapter (tokens and log-probs) and naming one never loaded, unloads."""
    import base64
    import pickle

    from tests.serve.test_serve_lora import peft_adapter

    config, tensors, model = peft_adapter(demo_model_dir, seed=31, rank=8)
    model.save_pretrained(tmp_path / "adapter")
    by_value = {"lora_name": "diff-t", "config_dict": config,
                "serialized_named_tensors": [base64.b64encode(pickle.dumps(dict(tensors))).decode()]}
    steps = [("/load_lora_adapter_from_tensors", by_value, 200),
             ("/load_lora_adapter_from_tensors", by_value, 400),  # already loaded
             ("/load_lora_adapter_from_tensors", {**by_value, "lora_name": "diff-r", "config_dict": {**config, "r": 16}},
              400),  # above --max-lora-rank
             ("/load_lora_adapter", {"lora_name": "diff-d", "lora_path": str(tmp_path / "adapter")}, 200),
             ("/generate", {"input_ids": PROMPT, "lora_path": "diff-nope", "sampling_params": {"max_new_tokens": 1}}, 400),
             ("/unload_lora_adapter", {"lora_name": "diff-t"}, 200),
             ("/unload_lora_adapter", {"lora_name": "diff-t"}, 400),
             ("/unload_lora_adapter", {"lora_name": "diff-d"}, 200)]
    for path, body, code in steps:
        if path == "/unload_lora_adapter" and body["lora_name"] == "diff-t" and code == 200:
            # under the adapter, before it goes: the same greedy tokens and input log-probs
            gen = {"input_ids": PROMPT, "lora_path": "diff-t", "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            real, ours = (r.json() for r in _both(sglang_lora_server, standin_lora_server, "POST", "/generate", gen))
            assert ours["output_ids"] == real["output_ids"]
            pairs = list(zip(ours["meta_info"]["input_token_logprobs"][1:],
                             real["meta_info"]["input_token_logprobs"][1:], strict=True))
            assert max(abs(o[0] - r[0]) for o, r in pairs) < 1e-4
        real, ours = _both(sglang_lora_server, standin_lora_server, "POST", path, body)
        assert (real.status_code, ours.status_code) == (code, code), (path, _json(real), _json(ours))
        assert _within(_shape(_json(ours)), _shape(_json(real))) == [], (_json(real), _json(ours))
        if path == "/generate":  # its list of adapters ever loaded depends on the server's history
            assert ours.json()["error"]["message"].split("\n")[0] == real.json()["error"]["message"].split("\n")[0]
            continue
        r, o = real.json(), ours.json()
        assert (o["success"], o["error_message"].split(". Loaded")[0]) == (r["success"], r["error_message"].split(". Loaded")[0])
        if code == 200:  # the adapter as listed after the call: its path, "__tensor__", or gone
            assert o["loaded_adapters"].get(body["lora_name"]) == r["loaded_adapters"].get(body["lora_name"])


def test_without_enable_lora_the_lora_requests_are_refused_alike(sglang_server, standin_server):
    for path, body in (("/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/where"}),
                       ("/unload_lora_adapter", {"lora_name": "x"}),
                       ("/generate", {"input_ids": PROMPT, "lora_path": "x", "sampling_params": {"max_new_tokens": 1}})):
        real, ours = _both(sglang_server, standin_server, "POST", path, body)
        assert (ours.status_code, ours.json()) == (real.status_code, real.json()) == (400, ours.json())
