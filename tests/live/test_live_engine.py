"""Our SGLang client against the released SGLang on this CPU: log-probs, C3PO++'s aborts and
resumes, and the weight checks (checksums and the probe) at start and after a push."""

from __future__ import annotations

import functools

import pytest
import requests
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.weights.check import WeightMismatch
from rlrecipe.rollout.weights.probe import Scores, probe_sequences
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory
from tests.live.conftest import Front

PROMPT = [5, 6, 7, 8, 9, 10]


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir):
    return load_model(model_dir).eval()


def _hf_logprobs(model_dir, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[k] | ids[:k]) for k >= 1, in float32 with transformers, logits / temperature."""
    model = _hf_model(model_dir)  # loaded once per model: the probe scores several sequences
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _generate(url: str, temperature: float, new: int = 8) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": new, "temperature": temperature,
                                                                   "sampling_seed": 3}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_fp32_logprobs_agree_with_the_trainer_to_rounding(sglang_server, demo_model_dir):
    out = _generate(sglang_server.url, 1.0)
    ids = PROMPT + out["output_ids"]
    ours = _hf_logprobs(demo_model_dir, ids)
    theirs = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] + \
             [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert out["meta_info"]["input_token_logprobs"][0][0] is None
    assert float((ours - torch.tensor(theirs)).abs().max()) < 1e-4


def test_at_another_temperature_sglang_tempers_output_logprobs_but_not_input_ones(sglang_server, demo_model_dir):
    """What the probe relies on: input_token_logprobs come from the raw logits, output_token_logprobs
    from the logits over the temperature."""
    t = 0.5
    out = _generate(sglang_server.url, t)
    ids = PROMPT + out["output_ids"]
    n_in = len(PROMPT) - 1
    raw, tempered = _hf_logprobs(demo_model_dir, ids), _hf_logprobs(demo_model_dir, ids, t)
    inputs = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    outputs = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert float((inputs - raw[:n_in]).abs().max()) < 1e-4
    assert float((outputs - tempered[n_in:]).abs().max()) < 1e-4
    assert float((outputs - raw[n_in:]).abs().max()) > 1e-2  # the two differ: the test can tell them apart


def test_the_start_check_passes_on_the_padded_vocabulary_and_fails_on_other_weights(
        sglang_server, demo_model_dir, demo_model_perturbed):
    """SGLang holds the 261-row embedding padded to 320 rows and hashes the padded tensor."""
    tok = load_tokenizer(demo_model_dir)
    with SGLangEngine([sglang_server.url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
        eng.verify_export(demo_model_dir, 0, when="at start")
        assert eng.weights.check.no_checksum == set() and eng.weights.check.before[0].version == 0
    with SGLangEngine([sglang_server.url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
        with pytest.raises(WeightMismatch, match="at start, its weights are not the trainer's"):
            eng.verify_export(demo_model_perturbed, 0, when="at start")


def _scores(model_dir, seqs, version) -> Scores:
    return Scores(version, seqs, [_hf_logprobs(model_dir, s).tolist() for s in seqs])


def test_checksums_and_the_probe_each_decide_a_push(sglang_server, demo_model_dir, demo_model_perturbed):
    """A front that answers 200 to disk updates without loading them is stopped at the first push,
    once by the checksums and once, with /weights_checker hidden, by the probe's log-probs; a real
    push through the probe passes. The server is left on the demo model's weights."""
    tok = load_tokenizer(demo_model_dir)
    seqs = probe_sequences(tok)
    try:
        fake = Front(sglang_server.url, fake=("/update_weights_from_disk",))
        with SGLangEngine([fake.url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
            eng.verify_export(demo_model_dir, 0, when="at start")
            with pytest.raises(WeightMismatch, match="after the update to weight version 1, it still serves the "
                                                     r"weights of version 0 \(11 of 11 tensors compared differ"):
                eng.update_weights_from_disk(demo_model_perturbed, 1)
        fake.close()

        hidden = Front(sglang_server.url, hide=("/weights_checker",))
        with SGLangEngine([hidden.url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
            eng.expect_logprobs(_scores(demo_model_dir, seqs, 0))
            eng.expect_logprobs(_scores(demo_model_perturbed, seqs, 1))
            eng.update_weights_from_disk(demo_model_perturbed, 1)  # the probe decides: it passes
            assert eng.weights.check.no_checksum == {0}
        hidden.close()

        both = Front(sglang_server.url, fake=("/update_weights_from_disk",), hide=("/weights_checker",))
        with SGLangEngine([both.url], eos_token_id=tok.eos_token_id, served_dtype="float32", version=1) as eng:
            eng.expect_logprobs(_scores(demo_model_perturbed, seqs, 1))
            eng.expect_logprobs(_scores(demo_model_dir, seqs, 2))
            with pytest.raises(WeightMismatch, match="it still serves the weights of version 1 "
                                                     r"\(its log-probs of the probe are"):
                eng.update_weights_from_disk(demo_model_dir, 2)
        both.close()
    finally:
        r = requests.post(sglang_server.url + "/update_weights_from_disk",
                          json={"model_path": str(demo_model_dir), "weight_version": "default"}, timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text


def test_a_budgeted_call_aborts_in_flight_requests_and_they_resume(sglang_server, demo_model_dir):
    """C3PO++ against the real scheduler: the budget cuts requests mid-flight (finish_reason abort,
    partial outputs kept), and the next call resumes each from where it stopped."""
    tok = load_tokenizer(demo_model_dir)
    pool = [Trajectory(uid=f"p{k}", group_id=f"g{k // 4}", prompt_ids=PROMPT + [11 + k]) for k in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=200)
    with SGLangEngine([sglang_server.url], eos_token_id=tok.eos_token_id, served_dtype="float32") as eng:
        eng.generate(pool, params, token_budget=200)
        partial = {t.uid: len(t.response_ids) for t in pool if t.status == Status.RUNNING and t.response_ids}
        assert partial, [(t.status, len(t.response_ids)) for t in pool]
        eng.generate(pool, params)
    assert all(t.done for t in pool)
    resumed = [t for t in pool if t.uid in partial]
    assert all(len(t.response_ids) > partial[t.uid] and len(t.logp_infer) == len(t.response_ids) for t in resumed)
