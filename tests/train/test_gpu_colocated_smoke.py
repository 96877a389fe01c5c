"""The colocated hand-over on a real GPU (`make gpu-smoke`): the trainer's state leaves the device and
comes back, and training goes on as if it had stayed. Skipped without CUDA."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.base import TrainSample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Large enough that its weights and Adam's moments are hundreds of MB on the device."""
    from rlrecipe.modeling import create_tiny
    from rlrecipe.recipe.training import TinyModel

    return create_tiny(TinyModel(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=4096,
                                 max_position_embeddings=256), tmp_path_factory.mktemp("gpu") / "model", seed=3)


def _sample() -> TrainSample:
    return TrainSample(list(range(5, 69)), 8, TokenColumns(scale=torch.full((56,), 1.0 / 56)))


def _nll(lp, f):
    return -(lp * f.scale).sum(), {}


def on_device(eng) -> int:
    """Bytes of the engine's weights and optimizer state on the GPU (tied weights once)."""
    tensors = [*eng.model.parameters()] + [v for s in eng.optimizer.state.values() for v in s.values()
                                           if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors if t.is_cuda}.values())


def test_torch_engine_gives_the_gpu_back_and_trains_on_as_if_it_had_not(model_dir):
    from rlrecipe.train.torch_engine import TorchTrainEngine

    handed = TorchTrainEngine(model_dir, TrainerSection(lr=1e-3), total_steps=4)
    kept = TorchTrainEngine(model_dir, TrainerSection(lr=1e-3), total_steps=4)
    weights = sum(p.numel() * p.element_size() for p in handed.model.parameters())
    for eng in (handed, kept):
        eng.train_step([_sample()], _nll)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handed.offload_states("optimizer")
    after_optimizer = torch.cuda.memory_allocated()
    handed.offload_states("weights")
    after_weights = torch.cuda.memory_allocated()
    # Adam's two moments, then the weights themselves, left the device (to 1% of their bytes)
    assert before - after_optimizer == pytest.approx(2 * weights, rel=0.01)
    assert after_optimizer - after_weights == pytest.approx(weights, rel=0.01)
    handed.reload_states()
    # every byte came back: the engine's tensors exactly, and the allocator's count to less than 1 MiB
    # (it hands out a cached block whole when less than 1 MiB would remain: 987,136 bytes more on an H100)
    assert on_device(handed) == 3 * weights
    assert 0 <= torch.cuda.memory_allocated() - before < 1 << 20
    for eng in (handed, kept):
        eng.train_step([_sample()], _nll)
    for (name, a), b in zip(handed.model.state_dict().items(), kept.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


DEEPSPEED_WORKER = """
import json, sys, torch
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine
from tests.train.test_gpu_colocated_smoke import _nll, _sample
eng = DeepSpeedTrainEngine(sys.argv[1], TrainerSection(engine="deepspeed", zero_stage=3, lr=1e-3), 4, colocated=True,
                           ds_config_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
eng.train_step([_sample()], _nll)
torch.cuda.synchronize()
out = {"fused": type(eng.engine.optimizer.optimizer).__name__, "before": torch.cuda.memory_allocated()}
eng.offload_states("optimizer")
out["after_optimizer"] = torch.cuda.memory_allocated()
eng.offload_states("weights")
out["after_weights"] = torch.cuda.memory_allocated()
eng.reload_states()
out["reloaded"] = torch.cuda.memory_allocated()
out["loss"] = eng.train_step([_sample()], _nll).loss
print(json.dumps(out))
"""


def test_deepspeed_zero3_offloads_with_its_fused_adam(model_dir):
    """ZeRO-3's offload_states needs DeepSpeed's FusedAdam (a CUDA kernel it builds): built, used, and
    the state off the device and back."""
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_WORKER, str(model_dir)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert out["fused"] == "FusedAdam"
    assert out["after_optimizer"] < out["before"] and out["after_weights"] <= out["after_optimizer"]
    assert out["reloaded"] >= out["before"] * 0.99 and math.isfinite(out["loss"])
