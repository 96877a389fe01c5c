"""The algorithms against values derived by hand from their formulas."""

import math

import pytest
import torch

from rlrecipe.algo.advantages import sequence_advantages
from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.packing import allocate_microbatches, pack
from rlrecipe.algo.ppo import (
    LossSettings,
    aggregation_scale,
    importance_ratio_sums,
    mismatch_weights,
    offpolicy_token_drop,
    policy_loss,
    ppo_token_loss,
)


def test_global_advantage_is_token_weighted():
    # tokens: [5 | -5 -5 -5]; mean -2.5; population std sqrt(18.75)
    adv = sequence_advantages([5.0, -5.0], [1, 3], ["a", "b"], "global")
    s = math.sqrt(18.75)
    assert adv == pytest.approx([7.5 / (s + 1e-5), -2.5 / (s + 1e-5)])


def test_group_advantage_and_single_member_group():
    adv = sequence_advantages([5.0, -5.0, 5.0, 5.0], [2, 2, 2, 2], ["g", "g", "g", "h"], "group")
    std = math.sqrt(600 / 27)
    assert adv[0] == pytest.approx((10 / 3) / (std + 1e-5))
    assert adv[1] == pytest.approx(-(20 / 3) / (std + 1e-5))
    assert adv[3] == 0.0


def test_no_normalisation_keeps_reward():
    assert sequence_advantages([5.0, -5.0], [3, 1], ["a", "a"], "none") == [5.0, -5.0]


def test_ppo_clip_cases():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, clipped, dual = ppo_token_loss(logp, logp_old, adv, 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-1.2, 1.5, 0.8, -2.0])
    assert clipped.tolist() == [True, False, True, False]
    assert not dual.any()


def test_asymmetric_and_dual_clip():
    logp_old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.5, 5.0]))
    adv = torch.tensor([1.0, -1.0])
    loss, clipped, dual = ppo_token_loss(logp, logp_old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([-1.28, 3.0])
    assert clipped.tolist() == [True, False] and dual.tolist() == [False, True]


def test_icepop_band_and_tis():
    logp_infer = torch.zeros(4)
    logp_old = torch.log(torch.tensor([0.4, 1.0, 4.0, 6.0]))
    w, masked = mismatch_weights(logp_old, logp_infer, "icepop", 0.5, 5.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, 4.0, 0.0])
    assert masked.tolist() == [True, False, False, True]
    w, masked = mismatch_weights(logp_old, logp_infer, "tis", cap=2.0)
    assert w.tolist() == pytest.approx([0.4, 1.0, 2.0, 2.0]) and not masked.any()
    w, _ = mismatch_weights(logp_old, logp_infer, "off")
    assert w.tolist() == [1.0] * 4


def _fields(logp_old, adv, weight, scale):
    return TokenColumns(logp_old=logp_old, adv=adv, weight=weight, scale=scale)


def test_in_band_icepop_is_importance_weighted_ppo():
    logp_infer = torch.tensor([-1.0, -2.0, -0.5])
    logp_old = torch.tensor([-1.2, -1.9, -0.4])  # k all within [0.5, 5]
    logp = torch.tensor([-1.0, -2.1, -0.3], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    w, masked = mismatch_weights(logp_old, logp_infer, "icepop")
    assert not masked.any()
    scale = aggregation_scale([3], "token_mean")[0]
    loss, _ = policy_loss(logp, _fields(logp_old, adv, w, scale))
    k = torch.exp(logp_old - logp_infer)
    ratio = torch.exp(logp.detach() - logp_old)
    by_hand = (-torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * k).sum() / 3
    assert float(loss.detach()) == pytest.approx(float(by_hand))


def test_out_of_band_tokens_have_zero_gradient_but_count_in_normaliser():
    logp_infer = torch.zeros(4)
    logp_old = torch.log(torch.tensor([1.0, 9.0, 1.0, 0.1]))  # tokens 1 and 3 leave the band
    logp = logp_old.clone().requires_grad_(True)  # ratio 1 -> unclipped, d loss / d logp = -A * w * scale
    adv = torch.ones(4)
    w, masked = mismatch_weights(logp_old, logp_infer, "icepop")
    scale = aggregation_scale([4], "token_mean")[0]
    loss, _ = policy_loss(logp, _fields(logp_old, adv, w, scale))
    loss.backward()
    assert masked.tolist() == [False, True, False, True]
    assert logp.grad.tolist() == pytest.approx([-0.25, 0.0, -0.25, 0.0])
    # masked tokens stay in the normaliser: the two live tokens contribute -1 * 1/4 each
    assert float(loss.detach()) == pytest.approx(-0.5)


def test_seq_mean_token_mean_scale():
    s = aggregation_scale([1, 3], "seq_mean_token_mean")
    assert s[0].tolist() == [0.5] and s[1].tolist() == pytest.approx([1 / 6] * 3)
    t = aggregation_scale([1, 3], "token_mean")
    assert t[0].tolist() == [0.25]


def test_offpolicy_token_drop_uses_the_current_policy():
    # three sequences (ids 7, 7 | 3 | 5), the current policy's log-probs per token
    seq = torch.tensor([7, 7, 3, 5])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0])
    infer = torch.tensor([-0.2, -0.4, -0.95, -0.1])
    logp = torch.tensor([-1.0, -1.0, -1.0, -3.0], requires_grad=True)
    # mean log(pi_infer / pi_theta): seq 7 -> 0.7, seq 3 -> 0.05, seq 5 -> 2.9 (positive advantage: kept)
    assert offpolicy_token_drop(logp, infer, adv, seq, 0.5).tolist() == [True, True, False, False]
    # after an update the same sequences are judged again: seq 7 now close to the sampler, seq 3 far
    logp2 = torch.tensor([-0.3, -0.5, -2.0, -3.0])
    assert offpolicy_token_drop(logp2, infer, adv, seq, 0.5).tolist() == [False, False, True, False]


def test_policy_loss_stats_and_v32_mask_in_the_loss():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.0, 1.0, 5.0]))
    f = TokenColumns(logp_old=logp_old, adv=torch.tensor([1.0, -1.0, -1.0, -1.0]),
                     weight=torch.tensor([1.0, 0.0, 1.0, 1.0]), scale=torch.full((4,), 0.25),
                     logp_infer=torch.tensor([0.0, 0.0, 2.0, 0.0]), seq=torch.tensor([0, 1, 2, 3]))
    loss, st = policy_loss(logp, f, LossSettings(dual_clip=3.0, offpolicy_delta=1.0))
    # token 1 masked (IcePop weight 0); token 2: adv < 0 and log(pi_infer/pi_theta) = 2 > 1 -> dropped
    # token 0 clipped at 1.2 -> -1.2; token 3 ratio 5, adv -1 -> dual clip bound 3
    assert float(loss) == pytest.approx(0.25 * (-1.2 + 3.0))
    assert st.offpolicy_dropped_seqs == 1.0 and st.active_tokens == 2.0
    assert st.clipped_tokens == 1.0 and st.dual_clipped_tokens == 1.0
    assert st.ratio_sum == pytest.approx(1.5 + 5.0)
    # the early stop's statistic counts the same active tokens: ratios 1.5 and 5
    assert importance_ratio_sums(logp, f, LossSettings(offpolicy_delta=1.0)) == (pytest.approx(6.5), 2.0)
    assert importance_ratio_sums(logp, f, LossSettings()) == (pytest.approx(7.5), 3.0)  # without the mask
    stopped, st2 = policy_loss(logp, f, LossSettings(dual_clip=3.0, offpolicy_delta=1.0, stopped=True))
    assert float(stopped) == 0.0 and st2.ratio_sum == st.ratio_sum and st2.active_tokens == 2.0


def test_extreme_log_ratio_stays_finite():
    loss, _, _ = ppo_token_loss(torch.tensor([200.0]), torch.tensor([0.0]), torch.tensor([-1.0]))
    assert torch.isfinite(loss).all() and float(loss) == pytest.approx(torch.exp(torch.tensor(20.0)).item())
    w, masked = mismatch_weights(torch.tensor([0.0]), torch.tensor([-500.0]), "tis", cap=2.0)
    assert w.tolist() == [2.0]


def test_minibatch_slices_are_exact():
    from rlrecipe.stages.rl import minibatch_slices

    sizes = [s.stop - s.start for s in minibatch_slices(9, 4)]
    assert sizes == [3, 2, 2, 2]
    assert [s.stop - s.start for s in minibatch_slices(8, 4)] == [2, 2, 2, 2]
    assert [s.stop - s.start for s in minibatch_slices(3, 4)] == [1, 1, 1]
    assert minibatch_slices(9, 4)[-1].stop == 9


def test_allocation_fewest_balanced_complete():
    lengths = [5, 5, 5, 5, 4, 4, 2]
    bins = allocate_microbatches(lengths, 10)
    assert len(bins) == 3  # = ceil(30 / 10), the lower bound
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [10, 10, 10]


def test_allocation_balances_where_first_fit_would_not():
    lengths = [7, 5, 4, 4, 2]  # first-fit-decreasing alone packs [7, 5] and [4, 4, 2]: loads 12 and 10
    bins = allocate_microbatches(lengths, 12)
    assert len(bins) == 2
    assert [sum(lengths[i] for i in b) for b in bins] == [11, 11]


def test_overlong_sequence_gets_its_own_microbatch():
    bins = allocate_microbatches([3, 50, 4], 10)
    assert [1] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]


def test_pack_restarts_positions():
    ids, pos = pack([[7, 8, 9], [4, 5]])
    assert ids.tolist() == [[7, 8, 9, 4, 5]] and pos.tolist() == [[0, 1, 2, 0, 1]]


def test_packed_logprobs_equal_one_by_one(tiny_model_dir):
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.base import TrainSample
    from rlrecipe.train.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(max_tokens_per_microbatch=120), total_steps=1)
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(5, 250, (n,), generator=g).tolist(), 4) for n in [10, 37, 25, 60, 8]]
    assert len(eng.microbatches(samples)) == 2
    packed = eng.compute_logprobs(samples)
    for s, (lp, _) in zip(samples, packed, strict=True):
        with torch.no_grad():
            logits = eng.model(input_ids=torch.tensor([s.input_ids], device=eng.device)).logits[0].float().cpu()
        ref = torch.log_softmax(logits, -1)[s.start - 1:-1].gather(-1, torch.tensor(s.input_ids[s.start:])[:, None])
        assert torch.allclose(lp.cpu(), ref.squeeze(-1), atol=1e-5)
