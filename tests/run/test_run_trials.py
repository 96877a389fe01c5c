"""The trials of a demanding user, through the CLI: two launches at once, a second stage over a
finished run, a name that climbs out of output_dir, a kill followed by a damaged checkpoint;
and the trainer state that loads without running code."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine
from tests.helpers import beside, kill_once_checkpointed, rl_recipe, write_recipe, write_tiny_data
from tests.stages.test_sft import sft_recipe

pytestmark = pytest.mark.slow  # subprocess-heavy: `make test-fast` leaves it out

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "rlrecipe.cli.app"]


def _recipe(tmp_path, data, name):
    r = sft_recipe(tmp_path, data, name)
    r["sft"]["max_steps"] = 30  # long enough that a kill at step 4 lands before the end
    return r


def _digest_tree(path):
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".lock")}


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_s")} for r in rows]


def test_nothing_of_an_earlier_run_is_lost_to_a_second_launch(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data", n=48)
    rec = write_recipe(tmp_path / "sft.yaml", _recipe(tmp_path, data, "a"))
    run = tmp_path / "runs" / "a"
    # two launches of one recipe at once: the second is turned away, the first is undisturbed
    first = subprocess.Popen([*CLI, "sft", str(rec)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # mid-run, however fast the machine: it holds the directory
        second = subprocess.run([*CLI, "sft", str(rec)], env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    assert second.returncode == 2 and f"in use by pid {first.pid} " in second.stdout + second.stderr
    assert [r["step"] for r in _rows(run)] == list(range(1, 31))
    finished = _digest_tree(run / "checkpoints") | {f"final/{k}": v for k, v in _digest_tree(run / "final").items()}

    refusals = {
        "same recipe again": [*CLI, "sft", str(rec)],
        "rl under the same name": [*CLI, "rl", str(write_recipe(tmp_path / "rl.yaml", {
            **rl_recipe(tmp_path, data, str(tiny_model_dir)), "run": {
                "name": "a", "output_dir": str(tmp_path / "runs"), "init_from": str(tiny_model_dir)}}))],
        "a name that climbs out": [*CLI, "sft", str(rec), "--set", "run.name=../runs/a"],
    }
    expected = {"same recipe again": "holds checkpoints (up to step_0000030)",
                "rl under the same name": "holds an earlier 'sft' run; --overwrite",
                "a name that climbs out": "run.name: Value error, must be one non-empty directory name"}
    for what, cmd in refusals.items():
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        said = " ".join((out.stdout + out.stderr).split())
        assert out.returncode == 2 and expected[what] in said, (what, said)
        assert "Traceback" not in said
    after = _digest_tree(run / "checkpoints") | {f"final/{k}": v for k, v in _digest_tree(run / "final").items()}
    assert after == finished  # not one byte of the finished run changed


def test_a_killed_run_resumes_past_a_damaged_checkpoint_to_the_same_weights(tmp_path):
    data = write_tiny_data(tmp_path / "data", n=48)
    ref = write_recipe(tmp_path / "ref.yaml", _recipe(tmp_path, data, "ref"))
    rec = write_recipe(tmp_path / "killed.yaml", _recipe(tmp_path, data, "killed"))
    run = tmp_path / "runs" / "killed"
    with beside([*CLI, "sft", str(ref)], tmp_path / "ref.log", env=ENV):  # the uninterrupted reference
        kill_once_checkpointed([*CLI, "sft", str(rec)], env=ENV, checkpoint=run / "checkpoints" / "step_0000004")
        assert not (run / "final").exists()
        complete = sorted(p for p in (run / "checkpoints").glob("step_???????") if (p / "manifest.json").exists())
        assert len(complete) >= 2
        newest, fallback = complete[-1], complete[-2]
        weights = newest / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
        with (run / "metrics.jsonl").open("a") as f:
            f.write('{"step": 99, "loss"')  # and a metrics line cut short

        out = subprocess.run([*CLI, "sft", str(rec), "--resume"], env=ENV, timeout=600, capture_output=True,
                             text=True)
    said = " ".join(out.stderr.split())
    assert out.returncode == 0, said
    assert f"{newest.name}: damaged or incomplete (model/model.safetensors has" in said
    assert f"resuming from {fallback.name}, the newest complete checkpoint" in said
    a = load_file(tmp_path / "runs" / "ref" / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(run) == _rows(tmp_path / "runs" / "ref")  # every step once, with the same numbers


def test_trainer_state_loads_with_weights_only_and_restores_everything(tiny_model_dir, tmp_path):
    cfg = TrainerSection(lr=1e-2, lr_schedule="cosine", warmup_steps=1)
    sample = TrainSample([5, 6, 7, 8, 9], 2, TokenColumns(scale=torch.ones(3)))

    def loss(lp, f):
        return -(lp * f.scale).sum(), {}

    eng = TorchTrainEngine(tiny_model_dir, cfg, total_steps=4)
    eng.train_step([sample], loss)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    eng.save(tmp_path / "ckpt")
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)  # no pickled code
    assert state["steps_done"] == 1
    expected_draws = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(2).tolist())
    expected_step = eng.train_step([sample], loss)

    again = TorchTrainEngine(tiny_model_dir, cfg, total_steps=4)
    again.load(tmp_path / "ckpt")
    assert (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(2).tolist()) == expected_draws
    assert again.steps_done == 1 and again.scheduler.last_epoch == 1
    step = again.train_step([sample], loss)
    assert step.loss == expected_step.loss and step.lr == expected_step.lr
    for (name, x), y in zip(eng.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
