"""DAPO's dynamic sampling and overlong shaping, QAE's quantile baseline and Dr. GRPO's mean-only
baseline, each against a reference written from its paper's definition; dynamic sampling against
C3PO++'s token budget with a scripted engine that follows the engines' budget rule."""

import math
import random
import statistics

import pytest
import torch

from rlrecipe.algo.advantages import empirical_quantile, sequence_advantages
from rlrecipe.algo.dapo import group_has_signal, overlong_penalty
from rlrecipe.recipe.training import RLSection
from rlrecipe.rl.pool import RolloutPool
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


# -- references, written from the papers -------------------------------------------------------
def ref_quantile(values, k):
    """QAE's K-quantile: the smallest reward v whose empirical CDF P(R <= v) reaches K."""
    return min(v for v in values if sum(x <= v for x in values) / len(values) >= k)


def ref_group_advantages(rewards, groups, mode, k=0.4):
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = [rewards[i] for i in idx]
        for i in idx:
            if mode == "group_mean":  # Dr. GRPO: R_i - mean({R_j})
                out[i] = rewards[i] - statistics.fmean(r)
            else:  # QAE: (R_i - Q_K({R_j})) / (std({R_j}) + eps), the population std as GRPO's here
                out[i] = (rewards[i] - ref_quantile(r, k)) / (statistics.pstdev(r) + 1e-5)
    return out


def ref_overlong(length, l_max, cache):
    """DAPO's R_length(y): 0 when |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache
    inside the cache, -1 past L_max."""
    if length <= l_max - cache:
        return 0.0
    if length <= l_max:
        return ((l_max - cache) - length) / cache
    return -1.0


# -- Dr. GRPO and QAE --------------------------------------------------------------------------
def test_dr_grpo_subtracts_the_group_mean_and_nothing_else():
    rewards = [5.0, -5.0, -5.0, -5.0, 5.0, 5.0, 5.0, 5.0]
    groups = ["a"] * 4 + ["b"] * 4
    adv = sequence_advantages(rewards, [3] * 8, groups, "group_mean")
    # group a: mean -2.5; group b: all right, so nothing to learn from
    assert adv == [7.5, -2.5, -2.5, -2.5, 0.0, 0.0, 0.0, 0.0]
    grpo = sequence_advantages(rewards, [3] * 8, groups, "group")
    assert grpo[0] == pytest.approx(7.5 / (statistics.pstdev(rewards[:4]) + 1e-5))  # the std is what differs


def test_qae_gates_binary_rewards_into_its_two_regimes_by_hand():
    k = 0.4
    # hard query, 2 of 8 right (p = 0.25 <= 1 - K): the baseline is the failure reward, so only
    # the successes get credit
    hard = [5.0, 5.0] + [-5.0] * 6
    adv = sequence_advantages(hard, [1] * 8, ["h"] * 8, "group_quantile", k)
    std = statistics.pstdev(hard)
    assert adv == pytest.approx([10 / (std + 1e-5)] * 2 + [0.0] * 6)
    # easy query, 7 of 8 right (p = 0.875 > 1 - K): the baseline is the success reward, so only the
    # remaining failure is pushed down
    easy = [5.0] * 7 + [-5.0]
    adv = sequence_advantages(easy, [1] * 8, ["e"] * 8, "group_quantile", k)
    assert adv == pytest.approx([0.0] * 7 + [-10 / (statistics.pstdev(easy) + 1e-5)])
    # the boundary p = 1 - K (3 of 5 right, K = 0.4): still the hard regime, as the paper's p <= 1 - K
    edge = [5.0, 5.0, 5.0, -5.0, -5.0]
    assert float(empirical_quantile(torch.tensor(edge), 0.4)) == -5.0
    # p = 4/5 > 0.6: the easy regime
    assert float(empirical_quantile(torch.tensor([5.0, 5.0, 5.0, 5.0, -5.0]), 0.4)) == 5.0


def test_qae_and_dr_grpo_match_the_references_on_random_groups():
    rng = random.Random(0)
    for _ in range(200):
        n_groups, size = rng.randint(1, 5), rng.randint(1, 9)
        groups = [f"g{g}" for g in range(n_groups) for _ in range(size)]
        rng.shuffle(groups)  # members of a group need not be adjacent
        binary = rng.random() < 0.5
        rewards = [rng.choice([5.0, -5.0]) if binary else round(rng.uniform(-5, 5), 3) for _ in groups]
        k = rng.choice([0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, rng.random() * 0.98 + 0.01])
        lengths = [rng.randint(1, 50) for _ in groups]
        for mode in ("group_mean", "group_quantile"):
            got = sequence_advantages(rewards, lengths, groups, mode, k)
            assert got == pytest.approx(ref_group_advantages(rewards, groups, mode, k), abs=1e-9)
        if binary:  # QAE's gate: one side of every group gets no credit
            adv = sequence_advantages(rewards, lengths, groups, "group_quantile", k)
            for g in set(groups):
                idx = [i for i, x in enumerate(groups) if x == g]
                p = sum(rewards[i] > 0 for i in idx) / len(idx)
                zero_side = [i for i in idx if (rewards[i] < 0 if p <= 1 - k + 1e-12 else rewards[i] > 0)]
                assert all(adv[i] == 0 for i in zero_side)


# -- overlong shaping --------------------------------------------------------------------------
def test_overlong_penalty_by_hand_and_against_the_paper_on_random_lengths():
    # L_max 20, cache 5: free up to 15, then -1/5 a token, -1 at the limit
    assert [overlong_penalty(n, 20, 5) for n in (0, 15, 16, 18, 20, 21)] == pytest.approx(
        [0, 0, -0.2, -0.6, -1.0, -1.0])
    assert overlong_penalty(18, 20, 5, factor=5.0) == pytest.approx(-3.0)
    assert overlong_penalty(20, 20, 0) == 0.0  # cache 0: off
    rng = random.Random(1)
    for _ in range(2000):
        l_max = rng.randint(1, 400)
        cache, n = rng.randint(1, l_max), rng.randint(0, l_max + 50)
        factor = rng.uniform(0, 5)
        assert overlong_penalty(n, l_max, cache, factor) == pytest.approx(factor * ref_overlong(n, l_max, cache))


def test_the_penalty_reads_a_resumed_response_whole_and_truncation_at_max_new_tokens(monkeypatch):
    """A rollout C3PO++'s budget cut stays partial in the pool (the pool tests below: only ended
    rollouts leave it); once resumed and ended, the penalty reads its whole length; one truncated
    at max_new_tokens gets the full penalty."""
    from rlrecipe.stages import rl as stage

    monkeypatch.setattr(stage, "grade_trajectories", lambda batch, tok, grader: [
        setattr(t, "correct", t.status == Status.FINISHED) for t in batch])
    cfg = RLSection(overlong={"cache": 10, "penalty": 2.0})
    resumed = Trajectory("a", [1], "g", response_ids=[0] * 36, status=Status.FINISHED)  # 30 + 6 after a cut
    cut = Trajectory("b", [1], "g", response_ids=[0] * 38, status=Status.TRUNCATED)
    cut.response_ids += [0, 0]  # at max_new_tokens 40
    short = Trajectory("c", [1], "g", response_ids=[0] * 30, status=Status.FINISHED)
    stage.grade([resumed, cut, short], None, None, cfg, max_new_tokens=40)
    assert resumed.reward == pytest.approx(5.0 - 2.0 * 6 / 10)
    assert cut.reward == pytest.approx(-5.0 - 2.0)
    assert short.reward == 5.0


def test_overlong_filter_takes_truncated_tokens_out_of_the_loss_but_not_the_normaliser():
    from rlrecipe.algo.columns import TokenColumns
    from rlrecipe.algo.ppo import LossSettings, aggregation_scale, policy_loss
    from rlrecipe.stages.rl import attach_ppo_fields
    from rlrecipe.train.base import TrainSample
    from rlrecipe.trajectory.arrays import TrajectoryBatch

    g = torch.Generator().manual_seed(0)
    lengths, statuses = [5, 8, 3, 6], [Status.FINISHED, Status.TRUNCATED, Status.FINISHED, Status.TRUNCATED]
    trajs = []
    for i, (n, st) in enumerate(zip(lengths, statuses, strict=True)):
        lp = (-torch.rand(n, generator=g)).tolist()
        trajs.append(Trajectory(f"t{i}", [1, 2], f"g{i // 2}", response_ids=[3] * n, logp_infer=lp, versions=[0] * n,
                                status=st, reward=5.0 if i % 3 == 0 else -5.0, correct=i % 3 == 0))
    batch = TrajectoryBatch.from_trajectories(trajs)
    logp_old = [torch.tensor(t.logp_infer) + 0.01 * torch.randn(len(t.logp_infer), generator=g) for t in trajs]
    results = {}
    for on in (False, True):
        samples = [TrainSample([1, 2] + t.response_ids, 2) for t in trajs]
        m = attach_ppo_fields(samples, batch, logp_old, RLSection(overlong={"filter": on}))
        for s, sc in zip(samples, aggregation_scale(lengths, "token_mean"), strict=True):
            s.columns.scale = sc
        cols = TokenColumns.cat([s.columns for s in samples])
        logp = (torch.cat(logp_old) + 0.05 * torch.randn(sum(lengths), generator=g)).requires_grad_()
        loss, _ = policy_loss(logp, cols, LossSettings())
        loss.backward()
        results[on] = (m, cols, logp.detach(), logp.grad.clone(), float(loss.detach()))
    m, cols, logp, grad, loss = results[True]
    assert m["overlong_filtered_frac"] == 0.5 and "overlong_filtered_frac" not in results[False][0]
    truncated = torch.cat([torch.full((n,), st == Status.TRUNCATED) for n, st in zip(lengths, statuses, strict=True)])
    assert torch.all(cols.weight[truncated] == 0) and torch.all(grad[truncated] == 0)
    assert torch.all(cols.scale == 1.0 / sum(lengths))  # the truncated tokens stay in the normaliser
    # reference: sum over the kept tokens of w max(-A r, -A clip(r, 0.8, 1.2)) / (all tokens), with
    # IcePop's w = k inside [0.5, 5], k = pi_old / pi_infer; its gradient by autograd on this formula
    x = logp.clone().requires_grad_()
    old = torch.cat(logp_old)
    infer = torch.cat([torch.tensor(t.logp_infer) for t in trajs])
    adv = torch.cat([torch.full((n,), a) for n, a in zip(lengths, sequence_advantages(
        batch.rewards, lengths, batch.group_ids, "global"), strict=True)])
    k = torch.exp(old - infer)
    w = torch.where((k >= 0.5) & (k <= 5.0), k, torch.zeros_like(k)) * ~truncated
    r = torch.exp(x - old)
    ref = (w * torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))).sum() / sum(lengths)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    assert torch.allclose(grad, x.grad.float(), rtol=1e-5, atol=1e-8)


# -- dynamic sampling, alone and under the token budget ----------------------------------------
def test_a_group_has_signal_when_its_verdicts_differ():
    assert group_has_signal([True, False, False]) and group_has_signal([False, True])
    assert not group_has_signal([True] * 4) and not group_has_signal([False] * 4)
    assert not group_has_signal([True])  # one sample cannot differ from itself


class ScriptedEngine:
    """Follows the engines' budget rule (admit, TokenBudget) one decoding step at a time: each
    rollout ends on eos at its scripted length, or is truncated at max_new_tokens."""

    def __init__(self, length):
        self.length, self.version, self.calls = length, 0, []

    def generate(self, trajs, params, token_budget=None, seed=0, refill=None):
        self.calls.append(token_budget)
        running = admit(trajs, params)
        budget = TokenBudget(token_budget)
        while running and not budget.reached:
            ended = 0
            for t in running:
                t.append(7, -0.5, self.version)
                if len(t.response_ids) >= self.length(t):
                    t.status = Status.FINISHED
                elif len(t.response_ids) >= params.max_new_tokens:
                    t.status = Status.TRUNCATED
                ended += budget.count(t)
            running = [t for t in running if not t.done]
            if refill is not None and ended and not budget.reached:  # refill: continuous
                running += admit(refill(ended), params)


def _index(t):
    return int(t.group_id.split("@")[1])  # the prompt stream's cursor when the group was drawn


def _pattern(t):
    """Verdicts by the group's index: all right, mixed, all wrong, mixed, ..."""
    i, j = _index(t), int(t.uid.split("#")[1])
    return [True, j == 0, False, j % 2 == 0][i % 4]


def judge_by_pattern(trajs):
    for t in trajs:
        t.correct = _pattern(t)
        t.reward = 5.0 if t.correct else -5.0
        t.meta["judged"] = t.meta.get("judged", 0) + 1


def _pool(**rl):
    rows = [{"id": f"p{i}", "prompt": f"q{i}", "answers": ["1"]} for i in range(40)]
    stream = PromptStream(rows, _CharTok(), "raw", seed=0, shuffle=False)
    return RolloutPool(RLSection(**rl), stream)


class _CharTok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}


def test_synchronous_dynamic_sampling_replaces_groups_without_signal(monkeypatch):
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    pool = _pool(prompts_per_step=4, samples_per_prompt=3, c3po={"enabled": False},
                 dynamic_sampling={"enabled": True})
    engine = ScriptedEngine(lambda t: 4)
    batch, stats = pool.collect(engine, SamplingParams(max_new_tokens=8), seed=5, judge=judge_by_pattern)
    # round 0 draws groups 0-3: 1 and 3 have signal, 0 and 2 are dropped; round 1 draws 4-5 (all
    # right, mixed), round 2 draws 6 (all wrong), round 3 draws 7 (mixed)
    assert sorted({_index(t) for t in batch}) == [1, 3, 5, 7]
    assert all(group_has_signal([t.correct for t in batch if t.group_id == g]) for g in {t.group_id for t in batch})
    assert len(batch) == 12 and all(t.meta["judged"] == 1 for t in batch)
    assert stats.dynamic.metrics() == {"ds_groups_judged": 8, "ds_groups_dropped": 4, "ds_dropped_tokens": 4 * 3 * 4,
                           "ds_signal_share": 0.5, "ds_prompts_drawn": 8, "ds_extra_prompts": 4, "ds_cap_hit": 0.0,
                           "ds_groups_over_cap": 0}
    assert stats.generated_tokens == 8 * 3 * 4
    assert len(engine.calls) == 4  # a round per refill


def test_synchronous_dynamic_sampling_stops_at_its_cap_and_fills_with_dropped_groups(monkeypatch):
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    pool = _pool(prompts_per_step=4, samples_per_prompt=3, c3po={"enabled": False},
                 dynamic_sampling={"enabled": True, "max_extra_prompts": 1})
    batch, stats = pool.collect(ScriptedEngine(lambda t: 4), SamplingParams(max_new_tokens=8), seed=5,
                                judge=judge_by_pattern)
    # round 1 draws one extra group (4, all right): groups 1 and 3 have signal, and the last dropped
    # group (4) fills one place, the one before it (2) the other
    assert sorted({_index(t) for t in batch}) == [1, 2, 3, 4]
    assert stats.dynamic.metrics()["ds_cap_hit"] == 1.0 and stats.dynamic.metrics()["ds_extra_prompts"] == 1
    assert stats.dynamic.metrics()["ds_groups_dropped"] == 1 and stats.dynamic.metrics()["ds_groups_judged"] == 5
    assert stats.dynamic.metrics()["ds_groups_over_cap"] == 2


def test_without_dynamic_sampling_a_synchronous_step_samples_the_same(monkeypatch):
    """Round 0 of a dynamic step uses the step's seed: a step where every group has signal is the
    step without dynamic sampling."""
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    seeds = []
    for ds in (False, True):
        pool = _pool(prompts_per_step=2, samples_per_prompt=2, c3po={"enabled": False},
                     dynamic_sampling={"enabled": ds})
        pool.stream.cursor = 1  # groups 1 and 2... 1 mixed, 2 all wrong
        engine = ScriptedEngine(lambda t: 3)
        engine.generate = (lambda orig: lambda trajs, params, seed=0, **kw: (seeds.append(seed), orig(
            trajs, params, seed=seed, **kw)))(engine.generate)
        pool.collect(engine, SamplingParams(max_new_tokens=8), seed=11, judge=judge_by_pattern)
    assert seeds[0] == seeds[1] == 11 and len(seeds) == 3 and seeds[2] != 11


def _lengths(t):
    # groups differ in length and members within a group too, so groups end over several calls
    return 2 + (_index(t) * 5 + int(t.uid.split("#")[1]) * 3) % 9


@pytest.mark.parametrize(("surplus", "refill"), [("carry", "per_call"), ("train", "per_call"), ("carry", "continuous")])
def test_budgeted_dynamic_sampling_trains_whole_groups_with_signal_up_to_phi(monkeypatch, tmp_path, surplus, refill):
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    budget, n = 40, 3
    c3po = {"enabled": True, "token_budget": budget, "pool_capacity": 9, "max_staleness": 2, "surplus": surplus,
            "refill": refill}
    pool = _pool(prompts_per_step=4, samples_per_prompt=n, dynamic_sampling={"enabled": True}, c3po=c3po)
    engine = ScriptedEngine(_lengths)
    params = SamplingParams(max_new_tokens=9)
    trained, dropped_total = [], 0
    for step in range(6):
        engine.version = step
        batch, stats = pool.collect(engine, params, seed=step, judge=judge_by_pattern)
        ds = stats.dynamic.metrics()
        groups = {}
        for t in batch:
            groups.setdefault(t.group_id, []).append(t)
        # whole groups, every member ended and judged once, each with signal (the cap is 4, never hit:
        # fewer than 4 groups complete a step here)
        assert all(len(g) == n and all(t.done and t.meta["judged"] == 1 for t in g) for g in groups.values())
        assert ds["ds_cap_hit"] == 0.0
        assert all(group_has_signal([t.correct for t in g]) for g in groups.values())
        # Phi counts the kept groups' tokens only
        tokens = sum(len(t.response_ids) for t in batch)
        assert tokens >= budget
        if surplus == "carry":  # whole groups until Phi; at most the last group's tokens past it
            assert tokens - max(sum(len(t.response_ids) for t in g) for g in groups.values()) < budget
        # held rollouts wait for a member still running; dropped groups are gone from the pool
        running = {t.group_id for t in pool.in_flight}
        assert all(t.done and t.group_id in running for t in pool.held)
        assert len(pool.in_flight) <= 9  # held rollouts take no place in Omega, nor do new groups past it
        assert ds["ds_held"] == len(pool.held)
        assert ds["ds_groups_judged"] == ds["ds_groups_dropped"] + round(ds["ds_signal_share"] * ds["ds_groups_judged"])
        assert ds["ds_groups_over_cap"] == 0
        assert ds["ds_extra_prompts"] == ds["ds_groups_dropped"]
        dropped_total += ds["ds_groups_dropped"]
        trained += batch
        # no token trains more than sigma policies after it was sampled
        assert all(step - v <= 2 for t in batch for v in t.versions)
    uids = [t.uid for t in trained]
    assert len(uids) == len(set(uids))  # nothing trains twice
    assert dropped_total > 0
    assert not {_index(t) % 4 for t in trained} & {0, 2}  # no all-right or all-wrong group ever trained
    # the pool, held rollouts included, survives a checkpoint
    pool.save(tmp_path / "pool.safetensors")
    again = _pool(prompts_per_step=4, samples_per_prompt=n, dynamic_sampling={"enabled": True}, c3po=c3po)
    again.load(tmp_path / "pool.safetensors")
    assert pool.held  # the checkpoint holds rollouts waiting for their groups
    for a, b in ((pool.in_flight, again.in_flight), (pool.held, again.held), (pool.carried, again.carried)):
        assert [t.uid for t in a] == [t.uid for t in b]
    # and the next steps go on as they would have
    for step in (6, 7):
        got = [p.collect(ScriptedEngine(_lengths), params, seed=step, judge=judge_by_pattern)[0] for p in (pool, again)]
        assert [(t.uid, t.response_ids, t.correct) for t in got[0]] == [(t.uid, t.response_ids, t.correct) for t in got[1]]


def test_budgeted_dynamic_sampling_past_its_cap_trains_groups_without_signal(monkeypatch):
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    pool = _pool(prompts_per_step=4, samples_per_prompt=2, dynamic_sampling={"enabled": True, "max_extra_prompts": 0},
                 c3po={"enabled": True, "token_budget": 30, "pool_capacity": 8, "max_staleness": 2})
    batch, stats = pool.collect(ScriptedEngine(lambda t: 5), SamplingParams(max_new_tokens=9), seed=0,
                                judge=judge_by_pattern)
    assert stats.dynamic.metrics()["ds_cap_hit"] == 1.0 and stats.dynamic.metrics()["ds_groups_dropped"] == 0
    assert stats.dynamic.metrics()["ds_groups_over_cap"] == stats.dynamic.metrics()["ds_groups_judged"] - round(
        stats.dynamic.metrics()["ds_signal_share"] * stats.dynamic.metrics()["ds_groups_judged"]) > 0
    assert {_index(t) % 4 for t in batch} & {0, 2}  # all-right and all-wrong groups trained


def test_stale_groups_leave_whole(monkeypatch):
    """Members of a group enter together and age together: sigma drops the held ones with the
    running one, so no half group is ever judged."""
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    pool = _pool(prompts_per_step=4, samples_per_prompt=2, dynamic_sampling={"enabled": True},
                 c3po={"enabled": True, "token_budget": 12, "pool_capacity": 8, "max_staleness": 0})
    # the odd groups (mixed verdicts) end at 3 tokens and fill the budget; member #1 of an even
    # group needs 30 tokens, so its #0 is held when the step ends
    engine = ScriptedEngine(lambda t: 3 if _index(t) % 2 or t.uid.endswith("#0") else 30)
    params = SamplingParams(max_new_tokens=30)
    first, stats = pool.collect(engine, params, seed=0, judge=judge_by_pattern)
    held = {t.group_id for t in pool.held}
    assert held and all(t.age == 1 for t in pool.held + pool.in_flight)
    second, stats2 = pool.collect(engine, params, seed=1, judge=judge_by_pattern)
    assert stats2.dropped >= 2 * len(held)  # each stale group: its held and its running member
    assert not held & {t.group_id for t in pool.held + pool.in_flight + second}


def test_the_new_fields_enter_the_sha256_only_when_set():
    from rlrecipe.recipe.schema import load_recipe
    from tests.helpers import REPO

    base = load_recipe(REPO / "recipes" / "tiny_rl.yaml")
    for over in (["rl.dynamic_sampling.enabled=false"], ["rl.overlong.cache=0"], ["rl.adv_quantile=0.4"]):
        assert load_recipe(REPO / "recipes" / "tiny_rl.yaml", over).sha256 == base.sha256
    for over, key in ((["rl.dynamic_sampling.enabled=true"], "dynamic_sampling"), (["rl.overlong.filter=true"], "overlong"),
                      (["rl.adv_norm=group_quantile", "rl.adv_quantile=0.6"], "adv_quantile")):
        changed = load_recipe(REPO / "recipes" / "tiny_rl.yaml", over)
        assert changed.sha256 != base.sha256 and key in changed.recipe.hashed()["rl"]
        assert key not in base.recipe.hashed()["rl"]


def _whole_group_formula(rewards: list[float], mode: str, k: float = 0.4) -> list[float]:
    """The papers' advantages over one whole group, written out: GRPO (R - mean) / (std + 1e-5),
    Dr. GRPO R - mean, QAE (R - the K-quantile) / (std + 1e-5); std over the group (population)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    if mode == "group_mean":
        return [r - mean for r in rewards]
    ordered = sorted(rewards)
    base = ordered[max(1, math.ceil(round(k * n, 9))) - 1] if mode == "group_quantile" else mean  # smallest v: #(<= v) >= k n
    return [(r - base) / (std + 1e-5) for r in rewards]


@pytest.mark.parametrize("adv_norm", ["group", "group_mean", "group_quantile"])
def test_under_c3po_a_group_baseline_trains_whole_groups_only(monkeypatch, tmp_path, adv_norm):
    """Groups straddle the budget (their members end over several calls): with a group baseline
    every trained group is whole, partial_group_responses is 0, and each response's advantage is the
    paper's formula over its whole group. tiny_rl's batch-wide baseline, on the same script, trains
    part groups (the metric can tell the two apart)."""
    monkeypatch.setattr("rlrecipe.rl.prompts.row_prompt_ids", lambda tok, row, template: [1, 2])
    n = 3
    c3po = {"enabled": True, "token_budget": 40, "pool_capacity": 9, "max_staleness": 2}
    params = SamplingParams(max_new_tokens=9)
    partial_global = 0
    global_pool = _pool(prompts_per_step=4, samples_per_prompt=n, adv_norm="global", c3po=c3po)
    pool = _pool(prompts_per_step=4, samples_per_prompt=n, adv_norm=adv_norm, c3po=c3po)
    trained = []
    for step in range(6):
        engine = ScriptedEngine(_lengths)
        engine.version = step
        partial_global += global_pool.collect(ScriptedEngine(_lengths), params, seed=step)[1].partial_group_responses
        batch, stats = pool.collect(engine, params, seed=step)
        assert stats.partial_group_responses == 0 and batch
        groups: dict[str, list[Trajectory]] = {}
        for t in batch:
            groups.setdefault(t.group_id, []).append(t)
        assert all(len(g) == n and all(t.done for t in g) for g in groups.values())
        assert sum(len(t.response_ids) for t in batch) >= 40
        judge_by_pattern(batch)
        got = sequence_advantages([t.reward for t in batch], [len(t.response_ids) for t in batch],
                                  [t.group_id for t in batch], adv_norm)
        want = {}
        for g in groups.values():
            want.update(zip([t.uid for t in g], _whole_group_formula([t.reward for t in g], adv_norm), strict=True))
        assert got == pytest.approx([want[t.uid] for t in batch], abs=1e-9)
        trained += batch
    assert len({t.uid for t in trained}) == len(trained)  # nothing trains twice
    assert partial_global > 0
    # held members of a group survive a checkpoint with the pool
    pool.save(tmp_path / "pool.safetensors")
    again = _pool(prompts_per_step=4, samples_per_prompt=n, adv_norm=adv_norm, c3po=c3po)
    again.load(tmp_path / "pool.safetensors")
    assert [t.uid for t in again.held] == [t.uid for t in pool.held]
