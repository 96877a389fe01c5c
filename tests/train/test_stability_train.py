"""The stability remedies on the training side, on the tiny model: entropy with gradient for the
loss, float16 loss scaling, the reference policy."""

import copy

import pytest
import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine


def _samples(lengths, start=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [TrainSample(torch.randint(5, 200, (n,), generator=g).tolist(), start) for n in lengths]
    n_tok = sum(s.num_response for s in samples)
    for s in samples:
        s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / n_tok))
    return samples


def _naive_entropy(model, samples):
    """Per-token entropy of each response from the full logits, one sequence at a time."""
    out = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.input_ids], device=model.device)).logits[0, s.start - 1:-1].float()
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
        assert f.entropy.requires_grad and f.entropy.shape == logp.shape
        seen.append(f.entropy.detach())
        return -(f.entropy * f.scale).sum(), {}

    stats = eng.train_step(samples, bonus_only, with_entropy=True)
    assert float(torch.cat(seen).mean()) == pytest.approx(float(naive), rel=1e-5)
    assert stats.loss == pytest.approx(-float(naive), rel=1e-5)
    assert stats.grad_norm == pytest.approx(float(naive_norm), rel=1e-4)

    def no_entropy(logp, f):
        assert f.entropy is None
        return -(logp * f.scale).sum(), {}

    eng.train_step(samples, no_entropy)  # the default leaves it out (SFT, PPO without a bonus)


# -- float16 loss scaling -----------------------------------------------------------------------
def test_loss_scaler_rules_by_hand():
    from rlrecipe.train.loss_scale import DynamicLossScaler

    sc = DynamicLossScaler(init_scale=8.0, window=2, hysteresis=2, min_scale=1.0)
    scales = []
    for overflow in [True, True, True, False, False, False, False, False, True, True, True, True, True]:
        sc.update(overflow)
        scales.append(sc.scale)
    # 1st overflow uses up the hysteresis, then halve; growth on the good step that follows 2 good
    # steps (and refills the hysteresis), again 2 later; then hysteresis, halvings, floor at 1
    assert scales == [8, 4, 2, 2, 2, 4, 4, 8, 8, 4, 2, 1, 1]
    assert not sc.can_lower()


def test_loss_scaler_follows_deepspeeds_rules_step_for_step(monkeypatch):
    import random

    from deepspeed.runtime.fp16 import loss_scaler as ds

    from rlrecipe.train.loss_scale import DynamicLossScaler

    monkeypatch.setattr(ds.dist, "get_rank", lambda: 0)  # it logs from rank 0; no process group here
    rng = random.Random(0)
    for window, hysteresis in [(5, 2), (3, 1), (2, 3)]:
        ours = DynamicLossScaler(init_scale=2.0**32, window=window, hysteresis=hysteresis, min_scale=1.0)
        theirs = ds.DynamicLossScaler(init_scale=2.0**32, scale_window=window, min_scale=1.0, delayed_shift=hysteresis,
                                      consecutive_hysteresis=False, raise_error_at_min_scale=False)
        for _ in range(300):
            overflow = rng.random() < 0.3
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert ours.scale == theirs.cur_scale and ours.hysteresis_left == theirs.cur_hysteresis


def _nll(logp, f):
    return -(logp * f.scale).sum(), {}


def _weights(eng):
    return {k: v.detach().clone() for k, v in eng.model.state_dict().items()}


def test_fp16_autocast_finds_its_scale_and_skips_overflowing_steps(tiny_model_dir):
    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-3, fp16_autocast=True), total_steps=30)
    samples = _samples([20, 30, 15])
    taken = 0
    for _ in range(30):
        before = _weights(eng)
        st = eng.train_step(samples, _nll)
        assert torch.isfinite(torch.tensor(st.loss))
        changed = any(not torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
        assert changed == (not st.skipped)  # an overflowing step leaves the weights alone
        assert st.overflow == st.skipped  # every skip here is an overflow the scaler handles
        taken += changed
    # 2^32 overflows float16 activation gradients: the first steps are skipped while it halves
    assert eng.loss_scaler.scale < 2.0**32 and taken >= 5


def test_an_injected_inf_gradient_skips_the_step_and_lowers_the_scale(tiny_model_dir):
    from rlrecipe.train.loss_scale import DynamicLossScaler

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-3, fp16_autocast=True), total_steps=8)
    eng.loss_scaler = DynamicLossScaler(init_scale=1024.0)  # low enough that real gradients fit
    samples = _samples([20, 30])
    poison = [False, True, True, False]
    hook = eng.model.get_input_embeddings().weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if poison[eng.steps_done] else g)
    stats = []
    for step in range(4):
        before = _weights(eng)
        stats.append(eng.train_step(samples, _nll))
        unchanged = all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
        assert unchanged == poison[step]
    hook.remove()
    assert [s.skipped for s in stats] == [False, True, True, False]
    assert [s.overflow for s in stats] == [False, True, True, False]
    # the scale each step ran with: the first overflow uses up the hysteresis (2), the second halves
    assert [s.loss_scale for s in stats] == [1024.0, 1024.0, 1024.0, 512.0]


def test_loss_scaler_state_survives_a_checkpoint(tiny_model_dir, tmp_path):
    cfg = TrainerSection(lr=1e-3, fp16_autocast=True)
    eng = TorchTrainEngine(tiny_model_dir, cfg, total_steps=4)
    eng.train_step(_samples([12]), _nll)
    eng.save(tmp_path / "ckpt")
    again = TorchTrainEngine(tiny_model_dir, cfg, total_steps=4)
    again.load(tmp_path / "ckpt")
    assert again.loss_scaler.state_dict() == eng.loss_scaler.state_dict() == {
        "scale": 2.0**32, "hysteresis_left": 1, "good_steps": 0}


def test_float16_weights_are_refused_by_the_torch_engine(tiny_model_dir):
    from rlrecipe.core.errors import UserError

    with pytest.raises(UserError, match="fp16_autocast"):
        TorchTrainEngine(tiny_model_dir, TrainerSection(), total_steps=1, dtype="float16")


def test_deepspeed_fp16_block_uses_areals_loss_scaling():
    from rlrecipe.train.deepspeed_setup import build_ds_config

    cfg = build_ds_config(TrainerSection(engine="deepspeed"), "float16", world=2)
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 5,
                           "hysteresis": 2, "min_loss_scale": 1}
    assert "fp16" not in build_ds_config(TrainerSection(engine="deepspeed"), "bfloat16", world=2)


def _graded_batch(eng, n=6, seed=0):
    """Trajectories sampled 'by' the trainer itself (logp_infer = its log-probs), half right."""
    from rlrecipe.trajectory.record import Status, Trajectory

    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(n):
        prompt = torch.randint(5, 200, (4,), generator=g).tolist()
        resp = torch.randint(5, 200, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        batch.append(Trajectory(f"t{i}", prompt, f"g{i // 2}", response_ids=resp, versions=[0] * len(resp),
                                status=Status.FINISHED, reward=5.0 if i % 2 else -5.0, correct=bool(i % 2)))
    out = eng.compute_logprobs([TrainSample(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in batch])
    for t, (lp, _) in zip(batch, out, strict=True):
        t.logp_infer = lp.tolist()
    from rlrecipe.trajectory.arrays import TrajectoryBatch

    return TrajectoryBatch.from_trajectories(batch)


def test_ppo_update_does_not_count_loss_scale_overflows_as_bad_steps(tiny_model_dir):
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields, ppo_update, recompute_old_logprobs

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-3, fp16_autocast=True), total_steps=4)
    cfg = RLSection(ppo_minibatches=2)
    batch = _graded_batch(eng)
    samples, logp_old, _ = recompute_old_logprobs(eng, batch)
    attach_ppo_fields(samples, batch, logp_old, cfg)
    m = ppo_update(eng, samples, cfg)  # 2^32 overflows both minibatches
    assert (m["minibatches"], m["overflow_minibatches"], m["skipped_minibatches"]) == (2.0, 2.0, 0.0)
    # both ran at 2^32 (the first overflow uses up the hysteresis); the second halved it
    assert m["loss_scale"] == 2.0**32 and eng.loss_scaler.scale == 2.0**31


def test_ppo_update_reports_the_remedies_that_are_on(tiny_model_dir):
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields, ppo_update, recompute_old_logprobs

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-3), total_steps=4)
    batch = _graded_batch(eng)
    off = RLSection(ppo_minibatches=1)
    samples, logp_old, _ = recompute_old_logprobs(eng, batch)
    attach_ppo_fields(samples, batch, logp_old, off)
    plain = ppo_update(eng, samples, off)
    assert not {"seq_ratio_mean", "seq_clip_frac", "cov_selected_frac", "kl_ref", "entropy_bonus",
                "loss_scale"} & set(plain)

    on = RLSection(ppo_minibatches=1, ratio_level="sequence", loss_agg="seq_mean_token_mean",
                   cov={"mode": "kl_cov", "kl_fraction": 0.1}, entropy_coef=0.01, negative_adv_scale=0.0)
    samples, logp_old, entropy = recompute_old_logprobs(eng, batch)
    fields = attach_ppo_fields(samples, batch, logp_old, on)
    assert fields["adv_negative_frac"] == 0.0
    m = ppo_update(eng, samples, on)
    n_tokens = sum(batch.response_lengths)
    # one minibatch, before its step: pi_theta = pi_old, so every s_i = 1 and nothing is clipped
    assert m["seq_ratio_mean"] == pytest.approx(1.0) and m["seq_clip_frac"] == 0.0
    # KL-Cov: max(1, floor(0.1 x tokens)) per micro-batch (one micro-batch here)
    assert m["cov_selected_frac"] == pytest.approx(max(1, int(0.1 * n_tokens)) / n_tokens)
    # the bonus: 0.01 x the seq-mean-token-mean entropy, all tokens active (TIS/IcePop weights 1)
    per_seq = [float(e.mean()) for e in entropy]
    assert m["entropy_bonus"] == pytest.approx(0.01 * sum(per_seq) / len(per_seq), rel=1e-4)


# -- the reference policy -----------------------------------------------------------------------
def test_reference_policy_is_a_frozen_copy_of_the_initial_weights(tiny_model_dir):
    from rlrecipe.train.reference import ReferencePolicy

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2, max_tokens_per_microbatch=40), total_steps=2,
                           temperature=0.7)
    ref = ReferencePolicy(tiny_model_dir, temperature=0.7, max_tokens_per_microbatch=40, chunk_tokens=7)
    samples = _samples([12, 30, 9, 17])
    before = [lp for lp, _ in eng.compute_logprobs(samples)]
    got = ref.logprobs(samples)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, before, strict=True))
    eng.train_step(samples, _nll)
    after = [lp for lp, _ in eng.compute_logprobs(samples)]
    assert not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(after, before, strict=True))
    again = ref.logprobs(samples)
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))
    assert not any(p.requires_grad for p in ref.model.parameters())


def test_reference_is_built_only_with_a_kl_coefficient(tiny_model_dir):
    from rlrecipe.recipe.schema import recipe_from_dict
    from rlrecipe.train.reference import ReferencePolicy, make_reference

    base = {"run": {"name": "r"}, "model": {"tiny": {}}}
    assert make_reference(recipe_from_dict(base), tiny_model_dir) is None
    with_kl = recipe_from_dict({**base, "rl": {"kl_coef": 0.05}})
    assert isinstance(make_reference(with_kl, tiny_model_dir), ReferencePolicy)


def test_kl_to_the_reference_through_ppo_update(tiny_model_dir):
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields, ppo_update, recompute_old_logprobs
    from rlrecipe.train.reference import ReferencePolicy

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(lr=1e-2), total_steps=4)
    ref = ReferencePolicy(tiny_model_dir)
    cfg = RLSection(ppo_minibatches=1, kl_coef=0.1, kl_estimator="k3_unbiased")
    batch = _graded_batch(eng)
    samples, logp_old, _ = recompute_old_logprobs(eng, batch, ref)
    attach_ppo_fields(samples, batch, logp_old, cfg)
    assert all(torch.allclose(s.columns.logp_ref, s.columns.logp_old, atol=1e-5) for s in samples)
    first = ppo_update(eng, samples, cfg)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    samples, logp_old, _ = recompute_old_logprobs(eng, batch, ref)
    attach_ppo_fields(samples, batch, logp_old, cfg)
    second = ppo_update(eng, samples, cfg)
    # one step later: the k3 estimate (ratio 1 before this step's update) by hand from the fields, each
    # token weighted by its behaviour correction (the weight column) as the policy term is
    by_hand = sum(float(((torch.exp(s.columns.logp_ref - s.columns.logp_old) - 1
                          - (s.columns.logp_ref - s.columns.logp_old)) * s.columns.weight).sum()) for s in samples)
    assert second["kl_ref"] == pytest.approx(by_hand / sum(s.num_response for s in samples), rel=1e-4)
    assert second["kl_ref"] > 1e-6
