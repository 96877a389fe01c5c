"""`rlrecipe serve --enable-lora`: SGLang's three LoRA endpoints and /generate's lora_path, with its
status codes and bodies (docs/sglang-cpu.md), and the adapter's numbers those of PEFT's merged model."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import requests
import torch

from tests.helpers import serving_in_thread

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class Died(Exception):
    pass


def peft_adapter(model_dir, seed: int, rank: int = 4):
    """A PEFT adapter on the model with B moved off zero: (config dict, tensors, the PEFT model)."""
    from transformers import AutoModelForCausalLM

    from rlrecipe.recipe.systems import LoraSection
    from rlrecipe.train import lora

    model = lora.wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                      LoraSection(rank=rank, alpha=16))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lora.adapter_config(model), lora.adapter_tensors(model), model


def peft_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def payload(tensors: dict) -> str:
    return base64.b64encode(pickle.dumps(dict(tensors))).decode()


@pytest.fixture
def served(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, chunk_tokens=4, enable_lora=True, max_lora_rank=8) as (port, sched):
        assert sched.ready.wait(120), "the stand-in did not warm up"

        def died(message):
            raise Died(message)

        sched.on_fatal = died
        yield f"http://127.0.0.1:{port}", sched


def post(url: str, path: str, body: dict):
    r = requests.post(url + path, json=body, timeout=120)
    return r.status_code, r.json()


def input_logprobs(url: str, lora: str | None) -> tuple[int, object]:
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}, **({"lora_path": lora} if lora else {})}
    code, out = post(url, "/generate", body)
    return code, ([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]] if code == 200 else out)


def test_an_adapter_from_tensors_serves_peft_merged_numbers_and_the_base_stays(served, tiny_model_dir):
    url, sched = served
    config, tensors, model = peft_adapter(tiny_model_dir, seed=1)
    _, base = input_logprobs(url, None)
    code, answer = post(url, "/load_lora_adapter_from_tensors",
                        {"lora_name": "a", "config_dict": config, "serialized_named_tensors": [payload(tensors)]})
    assert (code, answer) == (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                    "loaded_adapters": {"a": "__tensor__"}})
    code, got = input_logprobs(url, "a")
    want = peft_logprobs(model, PROMPT)
    assert code == 200 and max(abs(x - y) for x, y in zip(got, want, strict=True)) < 1e-5
    assert max(abs(x - y) for x, y in zip(got, base, strict=True)) > 1e-3  # the adapter moved them
    assert input_logprobs(url, None)[1] == base  # the base is exactly as it was
    # greedy decoding under the adapter is the merged model's too
    code, out = post(url, "/generate", {"input_ids": PROMPT, "lora_path": "a",
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    with torch.no_grad():
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, len(PROMPT):].tolist()
    assert code == 200 and out["output_ids"] == greedy


def test_the_lora_endpoints_answer_as_sglang(served, tiny_model_dir, tmp_path):
    url, sched = served
    config, tensors, model = peft_adapter(tiny_model_dir, seed=2)
    model.save_pretrained(tmp_path / "adapter")
    body = {"lora_name": "d", "lora_path": str(tmp_path / "adapter")}
    assert post(url, "/load_lora_adapter", body) == (200, {
        "rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
        "loaded_adapters": {"d": str(tmp_path / "adapter")}})
    code, answer = post(url, "/load_lora_adapter", body)
    assert code == 400 and answer["error_message"] == "Failed to load LoRA adapter d because it is already loaded"
    big = {**config, "r": 16}
    code, answer = post(url, "/load_lora_adapter_from_tensors",
                        {"lora_name": "big", "config_dict": big, "serialized_named_tensors": [payload(tensors)]})
    assert code == 400 and "with rank 16 is incompatible" in answer["error_message"]
    code, answer = post(url, "/generate", {"input_ids": PROMPT, "lora_path": "nope",
                                           "sampling_params": {"max_new_tokens": 1}})
    assert code == 400 and answer == {"error": {"message": "Got LoRA adapter that has never been loaded: nope\n"
                                                           "All loaded adapters: dict_keys(['d'])."}}
    assert post(url, "/unload_lora_adapter", {"lora_name": "d"})[1]["loaded_adapters"] == {}
    code, answer = post(url, "/unload_lora_adapter", {"lora_name": "d"})
    assert (code, answer["success"], answer["loaded_adapters"]) == (400, False, None)
    assert answer["error_message"] == "LoRA with name d does not exist. Loaded LoRAs: odict_keys([])"
    # named again after its unload: loaded again from its path, silently, as SGLang does
    code, got = input_logprobs(url, "d")
    assert code == 200 and max(abs(x - y) for x, y in zip(got, peft_logprobs(model, PROMPT), strict=True)) < 1e-5
    assert sched.adapters.order == ["d"]
    # a payload SGLang cannot unpickle kills its scheduler: the stand-in's end too
    with pytest.raises(requests.RequestException):
        post(url, "/load_lora_adapter_from_tensors",
             {"lora_name": "bad", "config_dict": config, "serialized_named_tensors": ["aGVsbG8="]})


def test_without_enable_lora_the_endpoints_refuse(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, chunk_tokens=4) as (port, sched):
        url = f"http://127.0.0.1:{port}"
        code, answer = post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/where"})
        assert (code, answer) == (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message":
                                        "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
                                        "loaded_adapters": None})
        assert sched.ready.wait(120)
        code, answer = post(url, "/generate", {"input_ids": PROMPT, "lora_path": "x",
                                               "sampling_params": {"max_new_tokens": 1}})
        assert code == 400 and "LoRA is not enabled" in json.dumps(answer)
