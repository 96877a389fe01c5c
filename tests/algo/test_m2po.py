"""M2PO's second-moment mask against its paper's Algorithm 1 written as a plain loop, by hand on a
small batch, and through the RL step's prepare phase (weights, overlong tokens, the recipe field)."""

import random

import pytest
import torch

from rlrecipe.algo.advantages import sequence_advantages
from rlrecipe.algo.m2po import batch_masks, second_moment_mask
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import recipe_from_dict
from rlrecipe.recipe.training import RLSection
from rlrecipe.trajectory.record import Status, Trajectory


def algorithm_1(log_r: list[float], adv: list[float], threshold: float) -> list[bool]:
    """Zheng et al. 2025, Algorithm 1, as written: T = the trust-region tokens; while the mean of
    (log r)^2 over T exceeds the threshold, mask argmax and take it out of T."""
    mask = [False] * len(log_r)
    trust = [i for i, (x, a) in enumerate(zip(log_r, adv, strict=True)) if (a > 0 and x > 0) or (a < 0 and x < 0)]
    while trust and sum(log_r[i] ** 2 for i in trust) / len(trust) > threshold:
        j = max(trust, key=lambda i: (log_r[i] ** 2, -i))  # the first of equal maxima, as argmax
        mask[j] = True
        trust.remove(j)
    return mask


def test_a_hand_worked_batch():
    # candidates: 0 (A > 0, r > 1, M2 .25), 1 (A < 0, r < 1, .09), 2 (A > 0, r > 1, .01); 3 cannot be clipped
    # mean .1167 > .04: mask 0; mean of .09 and .01 = .05 > .04: mask 1; .01 stays
    got = second_moment_mask(torch.tensor([0.5, -0.3, 0.1, 0.4]), torch.tensor([1.0, -1.0, 1.0, -1.0]), 0.04)
    assert got.tolist() == [True, True, False, False]
    # already within the bound: nothing masked; no candidates: nothing masked
    assert not second_moment_mask(torch.tensor([0.1, -0.1]), torch.tensor([1.0, -1.0]), 0.04).any()
    assert not second_moment_mask(torch.tensor([3.0, -3.0]), torch.tensor([-1.0, 1.0]), 0.04).any()
    # every candidate over the bound alone: all of them go, the others stay
    assert second_moment_mask(torch.tensor([1.0, 2.0, -5.0]), torch.tensor([1.0, 1.0, 1.0]), 0.04).tolist() == \
        [True, True, False]


@pytest.mark.parametrize("seed", range(40))
def test_the_mask_is_algorithm_1(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    spread = rng.choice([0.05, 0.2, 1.0])
    log_r = [round(rng.gauss(0, spread), rng.choice([2, 6])) for _ in range(n)]  # 2 places: many ties
    adv = [rng.choice([-1.5, -0.3, 0.0, 0.4, 2.0]) for _ in range(n)]
    threshold = rng.choice([0.001, 0.01, 0.04, 0.2])
    got = second_moment_mask(torch.tensor(log_r, dtype=torch.float64), torch.tensor(adv), threshold)
    assert got.tolist() == algorithm_1(log_r, adv, threshold)


def test_split_by_sequence_decides_over_the_whole_batch():
    log_rs = [torch.tensor([0.5, 0.0]), torch.tensor([-0.3]), torch.tensor([0.1, 0.4])]
    advs = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0]), torch.tensor([1.0, -1.0])]
    got = batch_masks(log_rs, advs, 0.04)
    assert [m.tolist() for m in got] == [[True, False], [True], [False, False]]


def test_the_prepare_step_weights_kept_tokens_by_k_and_masks_the_rest():
    from rlrecipe.stages.rl import attach_ppo_fields
    from rlrecipe.train.base import TrainSample
    from rlrecipe.trajectory.arrays import TrajectoryBatch

    g = torch.Generator().manual_seed(3)
    lengths = [6, 9, 4, 7]
    statuses = [Status.FINISHED, Status.FINISHED, Status.TRUNCATED, Status.FINISHED]
    trajs = [Trajectory(f"t{i}", [1, 2], f"g{i // 2}", response_ids=[3] * n,
                        logp_infer=(-torch.rand(n, generator=g)).tolist(), versions=[0] * n, status=st,
                        reward=5.0 if i in (0, 3) else -5.0, correct=i in (0, 3))
             for i, (n, st) in enumerate(zip(lengths, statuses, strict=True))]
    batch = TrajectoryBatch.from_trajectories(trajs)
    logp_old = [torch.tensor(t.logp_infer) + 0.4 * torch.randn(len(t.logp_infer), generator=g) for t in trajs]
    samples = [TrainSample([1, 2] + t.response_ids, 2) for t in trajs]
    cfg = RLSection(icepop={"mode": "m2po", "m2_threshold": 0.04}, overlong={"filter": True})
    out = attach_ppo_fields(samples, batch, logp_old, cfg)
    # reference: Algorithm 1 over the batch's tokens, the overlong-filtered response not a candidate
    adv = sequence_advantages(batch.rewards, lengths, batch.group_ids, cfg.adv_norm)
    log_r, tok_adv = [], []
    for t, lo, a, st in zip(trajs, logp_old, adv, statuses, strict=True):
        log_r += (lo - torch.tensor(t.logp_infer, dtype=torch.float32)).tolist()
        tok_adv += [0.0 if st == Status.TRUNCATED else a] * len(lo)
    want = algorithm_1(log_r, tok_adv, 0.04)
    assert any(want) and not all(want)
    k = torch.exp(torch.tensor(log_r))
    weight = torch.cat([s.columns.weight for s in samples])
    truncated = torch.cat([torch.full((n,), st == Status.TRUNCATED) for n, st in zip(lengths, statuses, strict=True)])
    masked = torch.tensor(want)
    assert torch.all(weight[masked] == 0) and torch.all(weight[truncated] == 0)
    kept = ~masked & ~truncated
    torch.testing.assert_close(weight[kept], k[kept])
    assert out["icepop_masked_frac"] == pytest.approx(sum(want) / sum(lengths))


def test_the_threshold_is_a_positive_number_and_hashed_only_when_set():
    base = {"run": {"name": "x"}, "model": {"tiny": {}}, "data": {"train": "d.jsonl"}}
    plain = recipe_from_dict(base)
    same = recipe_from_dict({**base, "rl": {"icepop": {"m2_threshold": 0.04}}})
    other = recipe_from_dict({**base, "rl": {"icepop": {"mode": "m2po", "m2_threshold": 0.1}}})
    assert plain.sha256() == same.sha256() and plain.algorithm_sha256() != other.algorithm_sha256()
    with pytest.raises(RecipeError, match="m2_threshold"):
        recipe_from_dict({**base, "rl": {"icepop": {"m2_threshold": 0}}})
