import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlrecipe.data.templates import prompt_token_ids
from rlrecipe.modeling import load_tokenizer
from rlrecipe.stages.sft import batch_for_step, build_sft_samples
from tests.helpers import TINY_MODEL, beside, kill_once_checkpointed, write_recipe, write_tiny_data


def sft_recipe(tmp, data, name):
    return {"run": {"name": name, "seed": 5, "output_dir": str(tmp / "runs")},
            "model": {"tiny": TINY_MODEL},
            "data": {"train": str(data / "sft.jsonl"), "prompt_template": "plain"},
            "sft": {"max_steps": 6, "batch_size": 8, "save_every": 2, "max_length": 200},
            "trainer": {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "max_tokens_per_microbatch": 400}}


def test_loss_only_on_response_tokens(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    rows = [{"id": "a", "prompt": "From 120 add 64 until above 200.", "response": "120+64=184\n184+64=248\n\\boxed{248}"}]
    (s,), cut = build_sft_samples(rows, tok, "plain", 512)
    prompt = prompt_token_ids(tok, rows[0]["prompt"], "plain")
    assert cut == 0 and s.start == len(prompt) and s.input_ids[:s.start] == prompt
    assert tok.decode(s.input_ids[s.start:]) == rows[0]["response"] + tok.eos_token
    # too long: the response is cut to max_length, and counted
    (short,), cut = build_sft_samples(rows, tok, "plain", len(prompt) + 3)
    assert cut == 1 and short.num_response == 3


def test_batches_depend_only_on_the_step():
    items = list(range(10))
    epoch0 = [x for step in range(3) for x in batch_for_step(items, step, 4, seed=1)]
    assert sorted(epoch0) == items  # one epoch covers every example once (last batch short)
    assert batch_for_step(items, 4, 4, seed=1) == batch_for_step(items, 4, 4, seed=1)
    assert batch_for_step(items, 3, 4, seed=1) != batch_for_step(items, 0, 4, seed=1)


@pytest.mark.slow
def test_killed_sft_resumes_to_the_same_final_weights(tmp_path):
    data = write_tiny_data(tmp_path / "data", n=48)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "sft"]
    ref = write_recipe(tmp_path / "ref.yaml", sft_recipe(tmp_path, data, "ref"))
    rec = write_recipe(tmp_path / "killed.yaml", sft_recipe(tmp_path, data, "killed"))
    run = tmp_path / "runs" / "killed"
    with beside([*cmd, str(ref)], tmp_path / "ref.log", env=env):  # the uninterrupted reference
        kill_once_checkpointed([*cmd, str(rec)], env, run / "checkpoints" / "step_0000002")
        assert not (run / "final").exists()
        subprocess.run([*cmd, str(rec), "--resume"], check=True, env=env, timeout=600, capture_output=True)
    a = load_file(tmp_path / "runs" / "ref" / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 6  # no step logged twice after the resume
