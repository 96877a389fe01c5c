"""AReaL's early stop (rl.early_stop_imp_ratio), decided over the whole PPO minibatch before its update."""

from __future__ import annotations

import math

import pytest
import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.recipe.training import RLSection
from rlrecipe.stages.rl import attach_ppo_fields, ppo_update, recompute_old_logprobs
from rlrecipe.train.base import StepResult, TrainSample, add_sums
from rlrecipe.train.torch_engine import TorchTrainEngine
from tests.train.test_stability_train import _graded_batch


class ScriptedTrainer:
    """Log-probs = logp_old + log(ratio of the sample); each sample its own micro-batch."""

    def __init__(self, ratios: list[float]):
        self.ratios, self.prepasses, self.losses = ratios, [], []

    def _logp(self, s: TrainSample) -> torch.Tensor:
        return s.columns.logp_old + math.log(self.ratios[s.input_ids[0]])

    def compute_logprobs(self, samples):
        self.prepasses.append([s.input_ids[0] for s in samples])
        return [(self._logp(s), torch.zeros(s.num_response)) for s in samples]

    def train_step(self, samples, loss_fn, with_entropy=False):
        sums: dict[str, float] = {}
        total = 0.0
        for s in samples:
            loss, stats = loss_fn(self._logp(s).requires_grad_(), TokenColumns.cat([s.columns], torch.device("cpu")))
            total += float(loss.detach())
            add_sums(sums, stats)
        self.losses.append(total)
        return StepResult(total, 1.0, 1e-6, skipped=False, sums=sums)


def _sample(index: int, tokens: int) -> TrainSample:
    s = TrainSample([index] + [7] * tokens, 1)
    c = s.columns
    c.logp_old = torch.full((tokens,), -1.0)
    c.adv, c.weight, c.scale = torch.ones(tokens), torch.ones(tokens), torch.full((tokens,), 1.0 / tokens)
    return s


def test_the_minibatch_decides_not_its_micro_batches():
    # minibatch 0: never examined (it trains the weights that scored logp_old)
    # minibatch 1: sample 2 alone has ratio 10 > 5, but the minibatch's token mean is (10x1 + 1x9) / 10 = 1.9
    # minibatch 2: (10x3 + 2x1) / 4 = 8 > 5: stopped, its loss 0 on every micro-batch
    ratios = [10.0, 10.0, 10.0, 1.0, 10.0, 2.0]
    samples = [_sample(0, 2), _sample(1, 2), _sample(2, 1), _sample(3, 9), _sample(4, 3), _sample(5, 1)]
    trainer = ScriptedTrainer(ratios)
    out = ppo_update(trainer, samples, RLSection(ppo_minibatches=3, early_stop_imp_ratio=5.0))
    assert trainer.prepasses == [[2, 3], [4, 5]]
    assert out["early_stopped_minibatches"] == 1.0
    assert trainer.losses[1] != 0.0 and trainer.losses[2] == 0.0
    # the stopped minibatch still reports its ratios: (20 + 2 + 10 + 9 + 30 + 2) / 18 tokens
    assert out["importance_ratio_mean"] == pytest.approx((20 + 10 + 9 + 30 + 2 + 20) / 18)


def test_without_the_option_nothing_is_examined():
    trainer = ScriptedTrainer([10.0] * 4)
    out = ppo_update(trainer, [_sample(i, 2) for i in range(4)], RLSection(ppo_minibatches=2))
    assert trainer.prepasses == [] and out["early_stopped_minibatches"] == 0.0 and trainer.losses[1] != 0.0


@pytest.mark.parametrize("threshold", [1.0001, 50.0])
def test_two_micro_batch_sizes_decide_alike(tiny_model_dir, threshold):
    """One micro-batch per minibatch against one per sample: the same decisions and the same weights."""
    cfg = RLSection(ppo_minibatches=2, early_stop_imp_ratio=threshold)
    results, weights = [], []
    for tokens in (10_000, 16):
        torch.manual_seed(0)
        eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=5e-2, max_tokens_per_microbatch=tokens),
                               total_steps=2)
        batch = _graded_batch(eng, n=8)
        samples, logp_old, _ = recompute_old_logprobs(eng, batch)
        attach_ppo_fields(samples, batch, logp_old, cfg)
        results.append(ppo_update(eng, samples, cfg))
        weights.append({k: v.clone() for k, v in eng.model.state_dict().items()})
    # a large step moves minibatch 2's ratio past 1.0001 (stopped), never past 50 (trained)
    assert results[0]["early_stopped_minibatches"] == results[1]["early_stopped_minibatches"] == float(threshold < 2)
    assert results[0]["importance_ratio_mean"] == pytest.approx(results[1]["importance_ratio_mean"], rel=1e-5)
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-4, abs=1e-7)
    # Adam divides by sqrt(v): a gradient summed in another order can move a near-zero entry's
    # step by a fraction of lr, so the weights agree to 1% of one step
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=0, atol=0.01 * 5e-2)
