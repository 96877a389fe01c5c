"""The stability remedies in the loss against values derived by hand (or a naive second
implementation): GSPO, Clip-Cov, KL-Cov, KL to a reference, entropy bonus, negative advantages."""

import math
from pathlib import Path

import pytest
import torch

from rlrecipe.algo.advantages import scale_negative_advantages, sequence_advantages
from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.cov import clip_cov_tokens, kl_cov_tokens, token_covariance
from rlrecipe.algo.gspo import sequence_log_ratio
from rlrecipe.algo.kl import kl_to_reference
from rlrecipe.algo.ppo import LossSettings, Remedies, policy_loss
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.trajectory.arrays import TrajectoryBatch

REPO = Path(__file__).resolve().parents[2]


def _fields(logp_old, adv, scale, **extra):
    n = len(logp_old)
    return TokenColumns(logp_old=logp_old, adv=adv, weight=torch.ones(n), scale=scale, **extra)


# -- GSPO ---------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_clip_and_gradient_by_hand():
    # seq 0: log-ratios 0.1, 0.3 -> s0 = e^0.2 = 1.2214 > 1 + 0.1, A = +1: clipped at 1.1, no gradient
    # seq 1: log-ratios -0.06, 0, 0.03 -> s1 = e^-0.01 = 0.99005, inside [0.95, 1.1], A = -1: unclipped
    logp_old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
    d = torch.tensor([0.1, 0.3, -0.06, 0.0, 0.03])
    logp = (logp_old + d).requires_grad_(True)
    seq = torch.tensor([0, 0, 1, 1, 1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    scale = torch.tensor([1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6])  # seq_mean_token_mean over G = 2 sequences
    rem = Remedies(ratio_level="sequence", seq_eps_low=0.05, seq_eps_high=0.1)
    loss, st = policy_loss(logp, _fields(logp_old, adv, scale, seq=seq), LossSettings(remedies=rem))
    loss.backward()
    s1 = math.exp(-0.01)
    # per sequence: -1.1 (clipped) and +s1, averaged over the two sequences
    assert float(loss.detach()) == pytest.approx((-1.1 + s1) / 2, rel=1e-6)
    # GSPO's gradient: s_i A_i / (G |y_i|) on every token of an unclipped sequence
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, s1 / 6, s1 / 6, s1 / 6], rel=1e-6)
    assert st.seqs == 2.0 and st.seq_clipped == 1.0
    assert st.seq_ratio_sum == pytest.approx(math.exp(0.2) + s1, rel=1e-6)
    assert st.clipped_tokens == 2.0  # both tokens of the clipped sequence


def test_gspo_matches_a_naive_per_sequence_objective():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    logp_old = -torch.rand(seq.numel(), generator=g) * 3
    logp0 = logp_old + torch.randn(seq.numel(), generator=g) * 0.1
    adv_seq = torch.tensor([1.3, 0.7, -0.4, -1.1])
    eps_low, eps_high = 0.005, 0.01  # sequences 1 and 2 leave the band on their clipped side

    # naive: s_i by autograd through the mean, one loss per sequence, mean over sequences (Eq. 5, 7)
    naive_logp = logp0.clone().requires_grad_(True)
    losses = []
    for i in range(len(lengths)):
        m = seq == i
        s = torch.exp((naive_logp[m] - logp_old[m]).mean())
        a = adv_seq[i]
        losses.append(torch.maximum(-s * a, -torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
    naive = torch.stack(losses).mean()
    naive.backward()

    logp = logp0.clone().requires_grad_(True)
    scale = torch.cat([torch.full((n,), 1 / (n * len(lengths))) for n in lengths])
    ours, _ = policy_loss(logp, _fields(logp_old, adv_seq[seq], scale, seq=seq), LossSettings(
        remedies=Remedies(ratio_level="sequence", seq_eps_low=eps_low, seq_eps_high=eps_high)))
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(naive.detach()), rel=1e-6)
    assert torch.allclose(logp.grad, naive_logp.grad, atol=1e-7)
    assert [bool((logp.grad[seq == i] == 0).all()) for i in range(4)] == [False, True, True, False]


def test_sequence_log_ratio_value_and_unit_gradient():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    out = sequence_log_ratio(logp, torch.tensor([-1.5, -2.0, -2.0]), torch.tensor([4, 4, 9]))
    assert out.tolist() == pytest.approx([0.25, 0.25, -1.0])
    out.sum().backward()
    assert logp.grad.tolist() == [1.0, 1.0, 1.0]


# -- Clip-Cov / KL-Cov --------------------------------------------------------------------------
# logp deviations from their mean (-2): 2, 1, 0, -1, -2; advantages (mean 0): 2, 1.5, 0, -0.5, -3
COV_LOGP = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])
COV_ADV = torch.tensor([2.0, 1.5, 0.0, -0.5, -3.0])


def test_token_covariance_by_hand():
    assert token_covariance(COV_LOGP, COV_ADV).tolist() == pytest.approx([4.0, 1.5, 0.0, 0.5, 6.0])


def test_clip_cov_draws_only_from_the_band():
    cov = token_covariance(COV_LOGP, COV_ADV)
    everyone = torch.ones(5, dtype=torch.bool)
    # band [1, 5] holds tokens 0 (4.0) and 1 (1.5); floor(0.2 * 5) = 1 token drawn from them at random
    seen = set()
    for seed in range(20):
        mask = clip_cov_tokens(cov, everyone, 0.2, 1.0, 5.0, torch.Generator().manual_seed(seed))
        assert int(mask.sum()) == 1
        seen.add(int(mask.nonzero()))
    assert seen == {0, 1}
    # floor(0.4 * 5) = 2: both; a tiny fraction still takes one token; no candidate in the band: none
    assert clip_cov_tokens(cov, everyone, 0.4, 1.0, 5.0).tolist() == [True, True, False, False, False]
    assert int(clip_cov_tokens(cov, everyone, 1e-6, 1.0, 5.0).sum()) == 1
    assert not clip_cov_tokens(cov, everyone, 0.4, 7.0, 9.0).any()


def test_clip_cov_in_the_loss_detaches_its_tokens_and_skips_ppo_clipped_ones():
    logp_old = COV_LOGP.clone()
    logp_old[0] -= 0.5  # token 0: ratio e^0.5 > 1.2 with A > 0 -> already held by the PPO clip
    logp = COV_LOGP.clone().requires_grad_(True)
    scale = torch.full((5,), 0.2)
    rem = Remedies(cov_mode="clip_cov", cov_fraction=0.4, clip_cov_low=1.0, clip_cov_high=5.0)
    loss, st = policy_loss(logp, _fields(logp_old, COV_ADV, scale), LossSettings(remedies=rem))
    loss.backward()
    # only token 1 is a candidate (token 0 clipped, the rest outside [1, 5]); its term keeps its value
    assert st.cov_selected_tokens == 1.0
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5 * 0.2, 3.0 * 0.2])
    assert float(loss.detach()) == pytest.approx(0.2 * (-2 * 1.2 - 1.5 + 0.0 + 0.5 + 3.0))


def test_kl_cov_penalises_the_top_tokens_by_hand():
    cov = token_covariance(COV_LOGP, COV_ADV)
    # top floor(0.4 * 5) = 2 by cov: tokens 4 (6.0) and 0 (4.0); candidates restrict the ranking
    assert kl_cov_tokens(cov, torch.ones(5, dtype=torch.bool), 0.4).tolist() == [True, False, False, False, True]
    no_four = torch.tensor([True, True, True, True, False])
    assert kl_cov_tokens(cov, no_four, 0.4).tolist() == [True, True, False, False, False]

    d = torch.tensor([0.1, 0.0, 0.0, 0.0, -0.1])  # logp - logp_old: ratios inside the PPO clip
    logp = COV_LOGP.clone().requires_grad_(True)
    rem = Remedies(cov_mode="kl_cov", cov_fraction=0.4, kl_cov_coef=1.0)
    loss, st = policy_loss(logp, _fields(COV_LOGP - d, COV_ADV, torch.full((5,), 0.2)), LossSettings(remedies=rem))
    loss.backward()
    r0, r4 = math.exp(0.1), math.exp(-0.1)
    # tokens 0 and 4 get + |logp - logp_old| = 0.1 each
    by_hand = 0.2 * ((-2 * r0 + 0.1) + (-1.5) + 0.0 + 0.5 + (3 * r4 + 0.1))
    assert float(loss.detach()) == pytest.approx(by_hand, abs=1e-6)
    assert logp.grad.tolist() == pytest.approx([0.2 * (-2 * r0 + 1), -0.3, 0.0, 0.1, 0.2 * (3 * r4 - 1)], rel=1e-6)
    assert st.cov_selected_tokens == 2.0


# -- KL to the reference ------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    # pi_theta = 0.5, pi_ref = 0.25, pi_old = 0.4: log(pi/pi_ref) = ln 2
    lp, lr, lo = (torch.tensor([math.log(x)]) for x in (0.5, 0.25, 0.4))
    ln2 = math.log(2)
    assert float(kl_to_reference(lp, lr, lo, "k1")) == pytest.approx(ln2)
    assert float(kl_to_reference(lp, lr, lo, "k2")) == pytest.approx(0.5 * ln2**2)
    assert float(kl_to_reference(lp, lr, lo, "k3")) == pytest.approx(0.5 - 1 + ln2)
    assert float(kl_to_reference(lp, lr, lo, "k3_unbiased")) == pytest.approx(1.25 * (0.5 - 1 + ln2))
    # d/dlogp of the unbiased term: (pi/pi_old) log(pi/pi_ref) = 1.25 ln 2 (the ratio is not detached)
    x = lp.clone().requires_grad_(True)
    kl_to_reference(x, lr, lo, "k3_unbiased").backward()
    assert float(x.grad) == pytest.approx(1.25 * ln2)


def test_k3_unbiased_is_exact_in_expectation_off_policy():
    """Over a 3-token vocabulary, the expectation under pi_old is computed exactly: the weighted k3
    gives KL(pi_theta || pi_ref) and its gradient; plain k3 gives neither."""
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    logp_old = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0]), -1)
    logp_ref = torch.log_softmax(torch.tensor([-0.5, 0.5, 0.0]), -1)

    def expect_under_old(estimator):
        logp = torch.log_softmax(theta, -1)
        return (logp_old.exp() * kl_to_reference(logp, logp_ref, logp_old, estimator)).sum()

    logp = torch.log_softmax(theta, -1)
    exact = (logp.exp() * (logp - logp_ref)).sum()
    (grad_exact,) = torch.autograd.grad(exact, theta)
    unbiased = expect_under_old("k3_unbiased")
    (grad_unbiased,) = torch.autograd.grad(unbiased, theta)
    assert float(unbiased.detach()) == pytest.approx(float(exact.detach()), rel=1e-6)
    assert torch.allclose(grad_unbiased, grad_exact, atol=1e-7)
    plain = expect_under_old("k3")
    (grad_plain,) = torch.autograd.grad(plain, theta)
    assert abs(float(plain.detach()) - float(exact.detach())) > 1e-2 and not torch.allclose(grad_plain, grad_exact, atol=1e-3)


def test_kl_term_in_the_loss_and_its_stat():
    logp_old = torch.tensor([-1.0, -1.0])
    logp = logp_old.clone().requires_grad_(True)  # ratio 1: PPO term -A * scale per token
    logp_ref = torch.tensor([-1.0 - math.log(2), -1.0])  # token 0: pi / pi_ref = 2; token 1: equal
    f = _fields(logp_old, torch.tensor([1.0, 1.0]), torch.full((2,), 0.5), logp_ref=logp_ref)
    loss, st = policy_loss(logp, f, LossSettings(remedies=Remedies(kl_coef=0.1, kl_estimator="k1")))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0 + 0.1 * 0.5 * math.log(2))
    assert st.kl_ref_sum == pytest.approx(math.log(2))
    assert logp.grad.tolist() == pytest.approx([-0.5 + 0.05, -0.5 + 0.05])  # d k1 / d logp = 1



def test_k3_unbiased_in_the_loss_is_exact_under_the_behaviour_policy():
    """Tokens sampled by pi_infer (the engine, or older weights under a lag), with pi_old the trainer's
    recomputation: the loss's KL term, weighted by the behaviour correction pi_old / pi_infer, has
    KL(pi_theta || pi_ref) and its gradient as its exact expectation under pi_infer (the scale column
    carries pi_infer's probabilities, so the loss is that expectation); unweighted it has neither."""
    from rlrecipe.algo.ppo import mismatch_weights

    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    logp_old = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0]), -1)
    logp_infer = torch.log_softmax(torch.tensor([0.2, 0.9, -0.4]), -1)
    logp_ref = torch.log_softmax(torch.tensor([-0.5, 0.5, 0.0]), -1)
    logp = torch.log_softmax(theta, -1)
    exact = (logp.exp() * (logp - logp_ref)).sum()
    (grad_exact,) = torch.autograd.grad(exact, theta)

    def kl_term(weight):
        cols = TokenColumns(logp_old=logp_old, adv=torch.zeros(3), weight=weight, scale=logp_infer.exp(),
                            logp_ref=logp_ref)
        loss, _ = policy_loss(torch.log_softmax(theta, -1), cols,
                              LossSettings(remedies=Remedies(kl_coef=1.0, kl_estimator="k3_unbiased")))
        return loss, torch.autograd.grad(loss, theta)[0]

    k, _ = mismatch_weights(logp_old, logp_infer, "tis", cap=100.0)  # no truncation: k = pi_old / pi_infer
    loss, grad = kl_term(k)
    assert float(loss.detach()) == pytest.approx(float(exact.detach()), rel=1e-6)
    assert torch.allclose(grad, grad_exact, atol=1e-7)
    loss, grad = kl_term(torch.ones(3))  # the behaviour correction off
    assert abs(float(loss.detach()) - float(exact.detach())) > 1e-2 and not torch.allclose(grad, grad_exact, atol=1e-3)

# -- entropy bonus ------------------------------------------------------------------------------
def test_entropy_bonus_counts_active_tokens_with_the_loss_scale():
    logp_old = torch.zeros(3)
    logp = logp_old.clone().requires_grad_(True)
    entropy = torch.tensor([1.0, 2.0, 0.5], requires_grad=True)
    f = TokenColumns(logp_old=logp_old, adv=torch.ones(3), weight=torch.tensor([1.0, 0.0, 1.0]),
                     scale=torch.full((3,), 1 / 3), entropy=entropy)
    loss, st = policy_loss(logp, f, LossSettings(remedies=Remedies(entropy_coef=0.1)))
    loss.backward()
    # PPO: -(1 + 1) / 3 from the two active tokens; bonus 0.1 * (1.0 + 0.5) / 3 (token 1 is masked)
    assert float(loss.detach()) == pytest.approx(-2 / 3 - 0.05)
    assert st.entropy_bonus == pytest.approx(0.05)
    assert entropy.grad.tolist() == pytest.approx([-0.1 / 3, 0.0, -0.1 / 3])


def test_remedies_off_change_nothing():
    g = torch.Generator().manual_seed(1)
    logp_old = -torch.rand(6, generator=g)
    logp = logp_old + 0.3 * torch.randn(6, generator=g)
    f = _fields(logp_old, torch.randn(6, generator=g), torch.full((6,), 1 / 6), seq=torch.tensor([0, 0, 1, 1, 1, 2]))
    plain, st = policy_loss(logp, f, LossSettings(eps_high=0.28))
    off, st_off = policy_loss(logp, f, LossSettings(eps_high=0.28, remedies=Remedies()))
    assert float(plain) == float(off) and st == st_off
    assert (st.seqs, st.cov_selected_tokens, st.kl_ref_sum, st.entropy_bonus) == (0.0, 0.0, 0.0, 0.0)


# -- negative advantages ------------------------------------------------------------------------
def test_negative_advantage_scale_after_normalisation():
    # tokens [5 | -5 -5 -5]: normalised 7.5 / (s + 1e-5) and -2.5 / (s + 1e-5), s = sqrt(18.75)
    adv = sequence_advantages([5.0, -5.0], [1, 3], ["a", "b"], "global")
    s = math.sqrt(18.75) + 1e-5
    assert scale_negative_advantages(adv, 0.5) == pytest.approx([7.5 / s, -1.25 / s])
    assert scale_negative_advantages(adv, 0.0) == pytest.approx([7.5 / s, 0.0])
    assert scale_negative_advantages(adv, 1.0) == adv


def test_attach_ppo_fields_scales_negatives_and_reports_it():
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields
    from rlrecipe.train.base import TrainSample
    from rlrecipe.trajectory.record import Trajectory

    trajs = [Trajectory("a", [1, 2], "g", response_ids=[3], logp_infer=[-1.0], reward=5.0),
             Trajectory("b", [1, 2], "g", response_ids=[4, 5, 6], logp_infer=[-1.0] * 3, reward=-5.0)]
    batch = TrajectoryBatch.from_trajectories(trajs)
    samples = [TrainSample(t.prompt_ids + t.response_ids, 2) for t in trajs]
    logp_old = [torch.full((len(t.response_ids),), -1.0) for t in trajs]
    cfg = RLSection(negative_adv_scale=0.0, icepop={"mode": "off"})
    m = attach_ppo_fields(samples, batch, logp_old, cfg)
    s = math.sqrt(18.75) + 1e-5
    assert samples[0].columns.adv.tolist() == pytest.approx([7.5 / s])
    assert samples[1].columns.adv.tolist() == [0.0, 0.0, 0.0]
    assert m["adv_token_mean"] == pytest.approx(7.5 / s / 4) and m["adv_negative_frac"] == 0.0
    m1 = attach_ppo_fields(samples, batch, logp_old, RLSection(icepop={"mode": "off"}))
    assert m1["adv_token_mean"] == pytest.approx(0.0, abs=1e-9) and m1["adv_negative_frac"] == 0.5


def test_kl_without_reference_logprobs_is_refused():
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields
    from rlrecipe.train.base import TrainSample
    from rlrecipe.trajectory.record import Trajectory

    batch = TrajectoryBatch.from_trajectories([Trajectory("a", [1], "g", response_ids=[3], logp_infer=[-1.0],
                                                          reward=5.0)])
    with pytest.raises(ValueError, match="reference log-probs"):
        attach_ppo_fields([TrainSample([1, 3], 1)], batch, [torch.tensor([-1.0])], RLSection(kl_coef=0.1))


# -- the recipe schema --------------------------------------------------------------------------
ON = {
    "rl.ratio_level=sequence": ["rl.loss_agg=seq_mean_token_mean"],
    "rl.cov.mode=clip_cov": [], "rl.cov.mode=kl_cov": [], "rl.kl_coef=0.01": [], "rl.kl_estimator=k3_unbiased": [],
    "rl.entropy_coef=0.001": [], "rl.entropy_watch.low=0.1": [], "rl.negative_adv_scale=0.5": [],
    "trainer.fp16_autocast=true": [],
}


@pytest.mark.parametrize("option", ON, ids=list(ON))
def test_every_remedy_is_off_by_default_and_changes_the_sha(option):
    base = load_recipe(REPO / "recipes/tiny_rl.yaml")
    also = load_recipe(REPO / "recipes/tiny_rl.yaml", ON[option])
    on = load_recipe(REPO / "recipes/tiny_rl.yaml", [*ON[option], option])
    assert on.sha256 != also.sha256 and on.sha256 != base.sha256
    rl = base.recipe.rl
    assert (rl.ratio_level, rl.cov.mode, rl.kl_coef, rl.entropy_coef, rl.negative_adv_scale) == \
        ("token", "off", 0.0, 0.0, 1.0)
    assert (rl.entropy_watch.low, rl.entropy_watch.high, base.recipe.trainer.fp16_autocast) == (None, None, False)


def test_schema_refuses_inconsistent_remedies():
    path = REPO / "recipes/tiny_rl.yaml"
    with pytest.raises(RecipeError, match="seq_mean_token_mean"):
        load_recipe(path, ["rl.ratio_level=sequence"])
    with pytest.raises(RecipeError, match="clip_low"):
        load_recipe(path, ["rl.cov.clip_low=5", "rl.cov.clip_high=1"])
    with pytest.raises(RecipeError, match="low .* must be below high"):
        load_recipe(path, ["rl.entropy_watch.low=3", "rl.entropy_watch.high=1"])
    with pytest.raises(RecipeError, match="fp16_autocast"):
        load_recipe(path, ["trainer.fp16_autocast=true", "trainer.bf16_autocast=true"])
    with pytest.raises(RecipeError, match="negative_adv_scale"):
        load_recipe(path, ["rl.negative_adv_scale=1.5"])
    with pytest.raises(RecipeError, match="kl_estimator"):
        load_recipe(path, ["rl.kl_estimator=k4"])
