"""The rollout simulator behind the C3PO++ projection: hand-computed schedules, the in-process
engine's semantics on the same lengths, calibration, and the steadiness measure."""

import zlib
from dataclasses import asdict

import pytest

from bench.c3po_compare import coefficient_of_variation, compare_streams
from bench.projection.calibration import calibrate
from bench.projection.lengths import Lengths, SyntheticStream
from bench.projection.rollout import project
from bench.projection.sim import CostModel, SimEngine, simulate
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.training import RLSection
from rlrecipe.rl.pool import RolloutPool
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rollout.base import SEED_KEY
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory

WORK = ("forward_passes", "decode_steps", "decode_rows", "decode_cells", "prefill_calls", "prefill_rows",
        "prefill_tokens", "prefill_cells", "reprefill_tokens", "refill_cells")


def _rows(lengths, prompt_len=3):
    return [Trajectory(uid=f"g{i}#0", group_id=f"g{i}", prompt_ids=[5 + i] * prompt_len) for i in range(len(lengths))]


@pytest.mark.parametrize("layout, clock", [
    # server: slots refill at once and a finished row leaves at once. Prefill A, B (6 tokens, 0.06);
    # steps with 2, 1 (A ended at 2), then C joins (0.03): 2, 2, 1 (B ended at 5), then C alone for
    # 5 more steps: 1.2 + 1.1 + 1.2 + 1.2 + 1.1 + 5 x 1.1 = 11.3; 11.3 + 0.09
    ("server", 11.39),
    # in-process: a finished row stays in the batch until compacting halves it, so the steps
    # after A and B end still carry 2 rows: 5 x 1.2 + 5 x 1.1 = 11.5; 11.5 + 0.09
    ("inprocess", 11.59),
])
def test_simulated_clock_matches_a_hand_computed_schedule(layout, clock):
    cost = CostModel(step_s=1.0, row_s=0.1, ctx_s=0.0, prefill_call_s=0.0, prefill_token_s=0.01)
    trajs = _rows([2, 5, 9])
    lengths = Lengths(100, known={t.uid: (n, "finished") for t, n in zip(trajs, [2, 5, 9], strict=True)})
    eng = SimEngine(cost, lengths, max_batch=2, layout=layout)
    eng.generate(trajs, SamplingParams(max_new_tokens=100))
    assert eng.clock == pytest.approx(clock)
    assert [len(t.response_ids) for t in trajs] == [2, 5, 9]
    assert all(t.status == Status.FINISHED and t.response_ids[-1] == eng.eos for t in trajs)
    assert eng.counters.decode_steps == 10 and eng.counters.prefill_tokens == 9


def test_lengths_past_max_new_tokens_truncate_and_the_budget_interrupts():
    cost = CostModel(step_s=1.0, row_s=0.0, ctx_s=0.0, prefill_call_s=0.0, prefill_token_s=0.0)
    trajs = _rows([3, 50, 4])
    eng = SimEngine(cost, Lengths(10, known={"g0#0": (3, ""), "g1#0": (50, ""), "g2#0": (4, "")}), max_batch=8)
    eng.generate(trajs, SamplingParams(max_new_tokens=10), token_budget=7)
    assert [t.status for t in trajs] == [Status.FINISHED, Status.RUNNING, Status.FINISHED]
    assert [len(t.response_ids) for t in trajs] == [3, 4, 4]
    eng.version = 1
    eng.generate(trajs, SamplingParams(max_new_tokens=10))
    assert trajs[1].status == Status.TRUNCATED and len(trajs[1].response_ids) == 10
    assert trajs[1].versions == [0] * 4 + [1] * 6
    assert eng.counters.reprefill_tokens == 4  # the resumed row re-prefills its 4 tokens


def test_resumed_rows_with_the_same_partial_response_are_prefilled_once():
    cost = CostModel(step_s=0.0, row_s=0.0, ctx_s=0.0, prefill_call_s=0.0, prefill_token_s=1.0)
    group = [Trajectory(uid=f"g#{j}", group_id="g", prompt_ids=[7] * 4) for j in range(3)]
    for t in group:
        t.response_ids = [3] * 5
    # g#1 began like g#0 for 6 tokens, g#2 for 2 only
    lengths = Lengths(40, known={t.uid: (20, "finished") for t in group}, shared={"g#1": {"g#0": 6}, "g#2": {
        "g#0": 2, "g#1": 2}})
    eng = SimEngine(cost, lengths, max_batch=8)
    eng.generate(group, SamplingParams(max_new_tokens=40), token_budget=1)
    assert eng.counters.prefill_tokens == 2 * 9  # g#0 and g#1 hold the same 5 tokens; g#2 differs
    assert eng.counters.prefill_cells == 3 * 9


def _seeded(trajs):
    for t in trajs:  # each draws from its own (seed, position) stream: lengths do not depend on batching
        t.meta[SEED_KEY] = zlib.crc32(t.uid.encode())
    return trajs


def _engine_with_ragged_lengths(model_dir, max_batch):
    """The tiny model, sampling, with as 'eos' a token it first says at many different positions, so
    rows end at different lengths (the untrained model never says its real eos)."""
    tok = load_tokenizer(model_dir)
    eng = InProcessEngine(model_dir, tok.eos_token_id, tok.pad_token_id, max_batch=max_batch)
    probe = _seeded([Trajectory(uid=str(i), prompt_ids=tok.encode(f"Add {i * 37} and {10 ** (i % 7)}."))
                     for i in range(16)])
    eng.generate(probe, SamplingParams(max_new_tokens=30))
    firsts: dict[int, set] = {}
    for t in probe:
        for v in set(t.response_ids):
            firsts.setdefault(v, set()).add(t.response_ids.index(v))
    eng.eos = max(firsts, key=lambda v: len(firsts[v]))
    return eng, tok


def _prompts(tok, n):
    trajs = [Trajectory(uid=f"q{i}#0", group_id=f"q{i}", prompt_ids=tok.encode(f"Add {i * 37} and {10 ** (i % 7)}."))
             for i in range(n)]
    for i, t in enumerate(trajs):  # some start with a partial response of their own
        for j in range((i * 5) % 9):
            t.append(tok.encode("0123456789")[(i + j) % 10], 0.0, -1)
    return _seeded(trajs)


class _SeededStream:
    def __init__(self, stream):
        self.stream = stream

    @property
    def cursor(self):
        return self.stream.cursor

    def next_group(self, n):
        return _seeded(self.stream.next_group(n))


def test_budget_interrupt_and_resume_follow_the_inprocess_engine(tiny_model_dir):
    eng, tok = _engine_with_ragged_lengths(tiny_model_dir, max_batch=4)
    params = SamplingParams(max_new_tokens=30)
    reference = eng.generate(_prompts(tok, 14), params)
    known = {t.uid: (len(t.response_ids), t.status.value) for t in reference}
    assert len({n for n, _ in known.values()}) >= 3 and any(s == "finished" for _, s in known.values())
    sim = SimEngine(CostModel(1e-3, 1e-4, 1e-7, 1e-3, 1e-5, 1e-8), Lengths(30, known=known), max_batch=4,
                    layout="inprocess", eos_token_id=eng.eos)
    real, simulated = _prompts(tok, 14), _prompts(tok, 14)
    for call, budget in enumerate([40, 25, None]):
        before = {e: asdict(e.counters) for e in (eng, sim)}
        eng.generate(real, params, token_budget=budget, seed=call)
        sim.generate(simulated, params, token_budget=budget, seed=call)
        assert [(t.status, len(t.response_ids)) for t in real] == [(t.status, len(t.response_ids)) for t in simulated]
        assert budget is None or any(t.status == Status.RUNNING for t in real)  # the budget interrupted
        for k in WORK:
            assert getattr(eng.counters, k) - before[eng][k] == getattr(sim.counters, k) - before[sim][k], k
        eng.version = sim.version = call + 1
    assert any(t.versions[-1] == 2 and t.versions[0] < 2 for t in real)  # some were resumed under a new version
    assert all(t.done for t in real)


@pytest.mark.parametrize("surplus", ["carry", "train"])
def test_pool_over_the_simulator_makes_the_engines_steps(tiny_model_dir, surplus):
    eng, tok = _engine_with_ragged_lengths(tiny_model_dir, max_batch=6)
    params = SamplingParams(max_new_tokens=30)
    rows = [{"id": f"p{i}", "prompt": f"Add {i * 37} and {10 ** (i % 7)}.", "answers": ["0"]} for i in range(40)]
    stream = _SeededStream(PromptStream(rows, tok, "plain", seed=0))
    reference = [t for _ in range(30) for t in stream.next_group(1)]
    eng.generate(reference, params)
    known = {t.uid: (len(t.response_ids), t.status.value) for t in reference}
    cfg = RLSection(prompts_per_step=4, samples_per_prompt=1,
                    c3po={"enabled": True, "token_budget": 40, "pool_capacity": 8, "max_staleness": 1,
                          "surplus": surplus})
    sim = SimEngine(CostModel(0, 0, 0, 0, 0), Lengths(30, known=known), max_batch=6, layout="inprocess",
                    eos_token_id=eng.eos)
    pools = [RolloutPool(cfg, _SeededStream(PromptStream(rows, tok, "plain", seed=0))) for _ in range(2)]
    before = asdict(eng.counters)
    for step in range(3):
        got = [pool.collect(e, params, seed=step)[0] for pool, e in zip(pools, (eng, sim), strict=True)]
        assert [(t.uid, len(t.response_ids), t.status) for t in got[0]] == [
            (t.uid, len(t.response_ids), t.status) for t in got[1]]
        assert [t.uid for t in pools[0].in_flight] == [t.uid for t in pools[1].in_flight]
        assert [t.uid for t in pools[0].carried] == [t.uid for t in pools[1].carried]
    for k in WORK:
        assert getattr(eng.counters, k) - before[k] == getattr(sim.counters, k), k
    assert sim.counters.reprefill_tokens > 0  # rollouts carried over and resumed


def _recorded(cost, layout="server", max_batch=12):
    """A bench.c3po_compare run over the simulator: step seconds are the cost model's exactly."""
    lengths = Lengths(40, groups=[[3, 9, 14, 40], [5, 6, 30, 33], [2, 2, 3, 8], [20, 25, 40, 12], [7, 18, 11, 16]])
    eng = SimEngine(cost, lengths, max_batch=max_batch, layout=layout)
    return compare_streams(eng, lambda: SyntheticStream(prompt_len=6), SamplingParams(max_new_tokens=40), steps=6,
                           prompts_per_step=5, samples_per_prompt=4, pool_capacity=24, clock=lambda: eng.clock)


def test_c3po_steps_train_at_least_their_budget_and_the_overshoot_is_reported():
    result = _recorded(CostModel(0.01, 0.001, 0.0001, 0.0, 0.0))
    budget, steps = result["token_budget"], [s for s in result["trace"]["steps"]["c3po"] if not s.get("warmup")]
    over = [s["tokens"] / budget - 1 for s in steps]
    assert min(over) >= 0  # the pool stops only once finished rollouts hold the budget
    assert result["c3po_over_budget_max"] == pytest.approx(max(over))
    assert result["c3po_over_budget_mean"] == pytest.approx(sum(over) / len(over))


def test_replay_reproduces_the_recorded_run_and_projects_it():
    cost = CostModel(step_s=7e-3, row_s=1.5e-5, ctx_s=2e-8, prefill_call_s=2e-3, prefill_token_s=3e-5,
                     train_step_s=1.0, train_token_s=1e-4)
    result = _recorded(cost)
    trace = result["trace"]
    replay = simulate(trace, cost)
    for mode in ("sync", "c3po"):
        assert [s["seconds"] for s in replay[mode]] == pytest.approx([s["seconds"] for s in trace["steps"][mode]])
        assert [s["tokens"] for s in replay[mode]] == [s["tokens"] for s in trace["steps"][mode]]
    proj = project(trace, cost)
    assert proj["speedup_per_trained_token"] == pytest.approx(result["rollout_speedup_per_trained_token"])
    assert proj["sync_cv_tokens_per_step"] == pytest.approx(result["sync_cv_tokens_per_step"])
    assert 0 < proj["end_to_end_speedup_per_trained_token"]
    assert proj["c3po_share_prefill"] + proj["c3po_share_decode"] + proj["c3po_share_refill"] == pytest.approx(1)
    # lengths from a distribution instead of the recorded ones
    drawn = project(trace, cost, groups=[[4, 30], [10, 12, 40]], prompt_len=6)
    assert drawn["sync_s_per_step"] > 0 and drawn["c3po_s_per_step"] > 0


@pytest.mark.parametrize("layout, by", [("server", "total"), ("inprocess", "total"), ("inprocess", "components"),
                                        ("inprocess", "events"), ("server", "events")])
def test_calibration_recovers_known_parameters(layout, by):
    inprocess = layout == "inprocess"
    truth = CostModel(step_s=7e-3, row_s=1.5e-5, ctx_s=2e-7, prefill_call_s=2e-3, prefill_token_s=3e-5,
                      prefill_cell_s=5e-7 if inprocess else 0.0, refill_cell_s=4e-7 if inprocess else 0.0)
    trace = _recorded(truth, layout=layout, max_batch=7)["trace"]
    fitted, check = calibrate(trace, by=by)
    for name in ("step_s", "row_s", "ctx_s", "prefill_call_s", "prefill_token_s", "prefill_cell_s", "refill_cell_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name
    assert check["r2_step_seconds"] == pytest.approx(1)
    assert check["replay_gap_decode_rows"] == 0 and check["replay_gap_prefill_tokens"] == 0


def test_coefficient_of_variation_by_hand():
    # mean 2.5; population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25; sqrt(1.25) / 2.5
    assert coefficient_of_variation([1, 2, 3, 4]) == pytest.approx(1.25 ** 0.5 / 2.5)
    assert coefficient_of_variation([5, 5, 5]) == 0 and coefficient_of_variation([7]) == 0


def test_calibration_of_some_parameters_holds_the_others():
    truth = CostModel(step_s=7e-3, row_s=1.5e-5, ctx_s=2e-7, prefill_call_s=2e-3, prefill_token_s=3e-5)
    trace = _recorded(truth)["trace"]
    fitted, check = calibrate(trace, params=("step_s", "row_s"), held=truth)
    assert (fitted.step_s, fitted.row_s) == pytest.approx((truth.step_s, truth.row_s), rel=1e-6)
    assert (fitted.ctx_s, fitted.prefill_token_s) == (truth.ctx_s, truth.prefill_token_s)
    assert 1 <= check["condition_number"] < float("inf")


def test_recipe_trace_is_one_rollout_engines_share_of_a_step():
    from bench.projection.rollout import recipe_trace
    from rlrecipe.recipe.schema import load_recipe

    recipe = load_recipe("recipes/7b_boba_icepop_c3po.yaml").recipe  # 64 servers, 512 x 16, pool 16384, budget 1e8
    s = recipe_trace(recipe, steps=3)["settings"]
    assert (s["engines"], s["prompts_per_step"], s["samples_per_prompt"]) == (64, 8, 16)
    assert (s["pool_capacity"], s["token_budget"], s["max_staleness"]) == (256, 1_562_500, 2)
    assert (s["max_new_tokens"], s["max_batch"], s["steps"], s["layout"]) == (27_648, 256, 3, "server")


def test_lognormal_groups_by_hand():
    from bench.projection.rollout import lognormal_groups

    # no spread: every length is the median; a median past max_new_tokens is cut there
    assert lognormal_groups(100, 0.0, 0.0, 4, 1000, n_groups=3) == [[100] * 4] * 3
    assert lognormal_groups(5000, 0.0, 0.0, 2, 1000, n_groups=1) == [[1000, 1000]]
    drawn = lognormal_groups(100, 0.5, 0.5, 8, 300, n_groups=50, seed=3)
    assert drawn == lognormal_groups(100, 0.5, 0.5, 8, 300, n_groups=50, seed=3)
    assert len(drawn) == 50 and all(len(g) == 8 and all(1 <= x <= 300 for x in g) for g in drawn)


def test_report_counts_decoded_tokens_and_batch_by_hand():
    from bench.projection.rollout import report

    def step(seconds, tokens, rows, steps, warmup=False, prefilled=2):
        rec = {"seconds": seconds, "tokens": tokens, "trained": 1,
               "counters": {"decode_rows": rows, "decode_steps": steps, "prefill_rows": prefilled, "prefill_s": 0.0,
                            "decode_s": seconds}}
        return {**rec, "warmup": True} if warmup else rec

    # each prefilled row gives its first token, so sync's 2 + 8 and 2 + 18 tokens are all it trains
    steps = {"sync": [step(9, 9, 9, 9, warmup=True), step(2, 10, 8, 4), step(4, 20, 18, 6)],
             "c3po": [step(9, 9, 9, 9, warmup=True), step(1, 10, 13, 3), step(2, 10, 13, 2)]}
    out = report(steps, CostModel(step_s=1, row_s=0, ctx_s=0, prefill_call_s=0, prefill_token_s=0))
    assert out["sync_generated_per_trained_token"] == pytest.approx(30 / 30)
    assert out["sync_mean_decode_batch"] == pytest.approx(26 / 10)
    assert out["c3po_generated_per_trained_token"] == pytest.approx(30 / 20)  # 10 generated tokens not trained
    assert out["c3po_mean_decode_batch"] == pytest.approx(26 / 5)


@pytest.mark.parametrize("pool, waits_for_the_longest", [(4, True), (8, False)])
def test_a_pool_of_one_batch_at_a_budget_of_its_tokens_waits_for_the_longest_rollout(pool, waits_for_the_longest):
    """Each prompt: three rollouts of 2 tokens and one of 6, so a batch (one prompt) holds 12 tokens.
    With the pool holding one batch and the budget at 12, a step can only reach its budget when
    the 6-token rollout ends: it decodes as long as a synchronous step. With two batches in flight,
    the six short rollouts reach it first and the step ends early."""
    settings = {"steps": 4, "prompts_per_step": 1, "samples_per_prompt": 4, "pool_capacity": pool,
                "max_staleness": 3, "token_budget": 12, "max_new_tokens": 50, "max_batch": 8,
                "refill_fraction": 0.25, "layout": "server", "prompt_len": 2}
    cost = CostModel(step_s=1.0, row_s=0.0, ctx_s=0.0, prefill_call_s=0.0, prefill_token_s=0.0)
    steps = simulate({"settings": settings, "trajectories": {"sync": [], "c3po": []}}, cost,
                     groups=[[2, 2, 2, 6]])
    sync = [s["seconds"] for s in steps["sync"][1:]]
    c3po = [s["seconds"] for s in steps["c3po"][1:]]
    assert len(set(sync)) == 1  # every synchronous step decodes until its 6-token rollout ends
    if waits_for_the_longest:
        assert c3po == sync
    else:
        assert sum(c3po) < sum(sync)


def test_continuous_refill_keeps_the_servers_batch_full():
    """The same schedule as above, two batches in flight: per call, the batch shrinks as the short
    rollouts end; continuous, their slots take new groups at once, so decoding steps carry more
    rows (never more than the pool), and every step trains exactly its budget's 12 tokens or more."""
    settings = {"steps": 6, "prompts_per_step": 1, "samples_per_prompt": 4, "pool_capacity": 8,
                "max_staleness": 3, "token_budget": 12, "max_new_tokens": 50, "max_batch": 8,
                "refill_fraction": 0.25, "layout": "server", "prompt_len": 2}
    cost = CostModel(step_s=1.0, row_s=0.0, ctx_s=0.0, prefill_call_s=0.0, prefill_token_s=0.0)
    batch = {}
    for refill in ("per_call", "continuous"):
        trace = {"settings": {**settings, "refill": refill}, "trajectories": {"sync": [], "c3po": []}}
        steps = simulate(trace, cost, groups=[[2, 2, 2, 6]])["c3po"][1:]
        rows = sum(s["counters"]["decode_rows"] for s in steps)
        batch[refill] = rows / sum(s["counters"]["decode_steps"] for s in steps)
        assert all(s["tokens"] >= 12 for s in steps)
    assert batch["per_call"] < batch["continuous"] <= 8


@pytest.mark.parametrize("kv_tokens, clock, decode_rows, prefill_tokens", [
    # Two 3-token prompts, 4-token responses each, a cache of 10 tokens. Both are admitted (3 + 1
    # and 3 + 1 of 10). Steps 1 and 2 decode both (contexts then 4 + 4 + 2 = 10: still fits);
    # before step 3 the next tokens need 5 + 5 + 2 = 12, so A (as few response tokens as B, the
    # first of them) is retracted and B decodes alone (1 row). B then ends, but A (6 tokens + 1)
    # cannot come back beside B's 6; once B has left, A is prefilled again (its prompt and 3
    # response tokens) and ends. 3 decoding steps of 2, 2, 1 rows; 2 prefills of 6 tokens each:
    # 3 x 1 + 5 x 0.1 + 2 x 0.5 + 12 x 0.01 = 4.62
    (10, 4.62, 5, 12),
    # unbounded: 3 steps of 2 rows, one prefill of 6 tokens: 3 + 0.6 + 0.5 + 0.06
    (None, 4.16, 6, 6),
])
def test_a_full_kv_cache_retracts_the_row_with_the_fewest_tokens(kv_tokens, clock, decode_rows, prefill_tokens):
    cost = CostModel(step_s=1.0, row_s=0.1, ctx_s=0.0, prefill_call_s=0.5, prefill_token_s=0.01)
    trajs = _rows([4, 4])
    lengths = Lengths(100, known={t.uid: (4, "finished") for t in trajs})
    eng = SimEngine(cost, lengths, max_batch=8, kv_tokens=kv_tokens)
    eng.generate(trajs, SamplingParams(max_new_tokens=100))
    assert all(t.status == Status.FINISHED and len(t.response_ids) == 4 for t in trajs)
    c = eng.counters
    assert (c.decode_steps, c.decode_rows, c.prefill_tokens) == (3, decode_rows, prefill_tokens)
    assert (c.retracted_rows, c.reprefill_tokens) == ((1, 3) if kv_tokens else (0, 0))
    assert eng.clock == pytest.approx(clock)


def test_a_kv_reserve_admits_fewer_rows_and_retracts_none():
    """The same two rollouts and cache, keeping half of each row's tokens to come free (50 of
    max_new_tokens 100): B (3 + 1 + 50 tokens) cannot join A, so they run one after the other,
    3 decoding steps each, and nothing is retracted: 6 x 1.1 + 2 x 0.5 + 6 x 0.01 = 7.66."""
    cost = CostModel(step_s=1.0, row_s=0.1, ctx_s=0.0, prefill_call_s=0.5, prefill_token_s=0.01)
    trajs = _rows([4, 4])
    lengths = Lengths(100, known={t.uid: (4, "finished") for t in trajs})
    eng = SimEngine(cost, lengths, max_batch=8, kv_tokens=10, kv_reserve=0.5)
    eng.generate(trajs, SamplingParams(max_new_tokens=100))
    c = eng.counters
    assert (c.decode_steps, c.decode_rows, c.prefill_calls, c.retracted_rows) == (6, 6, 2, 0)
    assert eng.clock == pytest.approx(7.66)


def test_the_plans_kv_cache_bounds_the_7b_recipes_projection():
    from rlrecipe.checks.plan import kv_cache_tokens
    from rlrecipe.recipe.schema import load_recipe

    # 0.80 x 80 GiB of SGLang pool, less the bf16 weights of R1-Distill-Qwen-7B's 7,615,616,512
    # parameters, in tokens of K and V over 28 layers x 4 kv heads x 128 dims in bf16
    by_hand = (int(0.80 * 80 * 2**30) - 2 * 7_615_616_512) // (2 * 28 * 4 * 128 * 2)
    assert by_hand == 932_760
    assert kv_cache_tokens(load_recipe("recipes/7b_boba_icepop_c3po.yaml", [])) == by_hand
    assert kv_cache_tokens(load_recipe("recipes/tiny_rl.yaml", [])) is None  # the in-process engine


def test_projection_cli_takes_a_recipe_and_assumed_lengths(capsys):
    from bench.projection.rollout import main

    out = main(["--recipe", "recipes/tiny_rl.yaml", "--lognormal", "40,0.3,0.3", "--steps", "2",
                "--set", "rl.c3po.pool_capacity=512"])
    s = out["settings"]
    assert (s["engines"], s["prompts_per_step"], s["pool_capacity"], s["max_new_tokens"]) == (1, 32, 512, 160)
    assert out["lengths"].startswith("ASSUMPTION: log-normal, median 40")
    assert out["projected"]["sync_generated_per_trained_token"] == pytest.approx(1.0)  # sync trains all it generates
    assert '"projected"' in capsys.readouterr().out
    assert s["kv_tokens"] is None  # tiny_rl's in-process engine: no server cache to bound it
    with pytest.raises(SystemExit):
        main(["--recipe", "recipes/tiny_rl.yaml"])  # no lengths to project with
