"""The stability remedies on the training side, on the tiny model: entropy with gradient for the
loss, float16 loss scaling, the reference policy."""

import copy

import pytest
import torch

from rlrecipe.recipe import TrainerSection
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine


def _samples(lengths, start=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [TrainSample(torch.randint(5, 200, (n,), generator=g).tolist(), start) for n in lengths]
    n_tok = sum(s.num_response for s in samples)
    for s in samples:
        s.fields = {"scale": torch.full((s.num_response,), 1.0 / n_tok)}
    return samples


def _naive_entropy(model, samples):
    """Per-token entropy of each response from the full logits, one sequence at a time."""
    out = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0, s.start - 1:-1].float()
        out.append(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1))
    return torch.cat(out)


def test_train_step_hands_the_loss_entropy_with_gradient(tiny_model_dir):
    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2, max_tokens_per_microbatch=40), total_steps=2)
    samples = _samples([12, 30, 9, 17])
    assert len(eng.microbatches(samples)) > 1
    naive_model = copy.deepcopy(eng.model).train()
    naive = _naive_entropy(naive_model, samples).mean()
    (-naive).backward()
    naive = naive.detach()
    naive_norm = torch.norm(torch.stack([p.grad.norm() for p in naive_model.parameters() if p.grad is not None]))

    seen = []

    def bonus_only(logp, f):
        assert f["entropy"].requires_grad and f["entropy"].shape == logp.shape
        seen.append(f["entropy"].detach())
        return -(f["entropy"] * f["scale"]).sum(), {}

    stats = eng.train_step(samples, bonus_only, with_entropy=True)
    assert float(torch.cat(seen).mean()) == pytest.approx(float(naive), rel=1e-5)
    assert stats["loss"] == pytest.approx(-float(naive), rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(float(naive_norm), rel=1e-4)

    def no_entropy(logp, f):
        assert "entropy" not in f
        return -(logp * f["scale"]).sum(), {}

    eng.train_step(samples, no_entropy)  # the default leaves it out (SFT, PPO without a bonus)
