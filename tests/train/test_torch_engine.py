"""The plain torch train engine."""

import pytest
import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine


def test_nan_loss_skips_the_update(tiny_model_dir):
    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2), total_steps=4)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    s = TrainSample([5, 6, 7, 8], 2, TokenColumns(scale=torch.ones(2)))
    stats = eng.train_step([s], lambda lp, f: ((lp * f.scale).sum() * float("nan"), {}))
    assert stats.skipped
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
    stats = eng.train_step([s], lambda lp, f: (-(lp * f.scale).sum(), {}))
    assert not stats.skipped
    assert any(not torch.equal(before[k], v) for k, v in eng.model.state_dict().items())


def test_colocated_hand_over_changes_nothing(tiny_model_dir):
    """Offloading the optimizer's state and the weights between steps, then reloading: the same
    weights after three steps as without, and the offloaded state lies in host memory."""
    s = TrainSample([5, 6, 7, 8, 9, 10], 2, TokenColumns(scale=torch.full((4,), 0.25)))

    def nll(lp, f):
        return -(lp * f.scale).sum(), {}

    plain = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2), total_steps=4)
    handed = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2), total_steps=4)
    for _ in range(3):
        plain.train_step([s], nll)
        handed.train_step([s], nll)
        handed.offload_states("optimizer")
        moments = [v for st in handed.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert moments and all(v.device.type == "cpu" for v in moments)
        handed.offload_states("weights")
        assert all(p.device.type == "cpu" for p in handed.model.parameters())
        handed.reload_states()
    for k, v in plain.model.state_dict().items():
        assert torch.equal(handed.model.state_dict()[k], v), k
    with pytest.raises(ValueError, match="'optimizer' or 'weights'"):
        handed.offload_states("gradients")
