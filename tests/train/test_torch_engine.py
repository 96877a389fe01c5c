"""The plain torch train engine."""

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
