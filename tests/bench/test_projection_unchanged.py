"""The simulator's fast path (SimEngine._skip_quiet: the steps in which a server only decodes, run at
once) and the process's cache of simulated rollouts leave every projected number as it was.

The values below were computed by the code before that change (commit 95f4a45, bench/ as of that
commit, run from a checkout of it: the same calls as here, printed with repr), and the code after it
printed the same, digit for digit. They cover an async projection (both schedules, both etas, two
splits, a bounded KV cache), a simulation whose servers retract rows (kv_reserve, a small cache and
batch) and a replay of recorded lengths with shared prefixes. docs/performance.md: before/after
timings of `make bench`'s projections.
"""

import random

from bench.projection.asynchronous import async_projection
from bench.projection.lengths import Lengths
from bench.projection.rollout import H100_7B_ASSUMED, lognormal_groups, recipe_trace
from bench.projection.sim import simulate
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.trajectory.record import Trajectory

RECIPE = "recipes/7b_boba_icepop_c3po.yaml"
GROUPS = lognormal_groups(1500, 0.4, 0.45, 16, 12000, n_groups=128)

# schedule -> [step_s, s_per_1m_trained_tokens], from the code before the change
ASYNC_BEFORE = {
    "sync, colocated": [95.39056931000003, 6.248019909574225],
    "sync, split as shipped": [110.76032556399994, 8.474404066906274],
    "C3PO++, colocated": [306.68410000000125, 3.0649853352786214],
    "C3PO++, split as shipped": [475.60296182800204, 4.7530986675176825],
    "async, eta=1": [69.52755056400002, 5.3196354765239215],
    "async, eta=2": [59.086052820999974, 5.318276581548153],
    "async + C3PO++, eta=1": [245.119525, 2.4496846764411195],
    "async + C3PO++, eta=2": [245.119525, 2.4496846764411195]}
# mode -> per step [seconds, tokens, rows retracted], the first the warm-up
RETRACTING_BEFORE = {
    "sync": [[272.0356271999999, 259330, 3], [187.63644385599918, 195513, 2], [205.5851515939973, 212924, 0]],
    "c3po": [[1553.0444580380001, 1562873, 18], [1456.166066528014, 1562892, 12], [1486.5925853718445, 1563479, 14]]}
# mode -> per step [seconds, tokens]
REPLAY_BEFORE = {
    "sync": [[7.901921045999994, 23839], [7.86673461400001, 22879], [7.916154566000021, 24127]],
    "c3po": [[5.508853946, 6494], [2.342524147999999, 6641], [1.5958308179999996, 24111]]}


def test_an_async_projection_prints_what_it_did_before():
    res = async_projection(RECIPE, GROUPS, etas=(1, 2), steps=2, splits=(64, 80), cost=H100_7B_ASSUMED, cache={})
    assert {r["schedule"]: [r["step_s"], r["s_per_1m_trained_tokens"]] for r in res["rows"]} == ASYNC_BEFORE


def test_servers_that_retract_rows_simulate_as_before():
    trace = recipe_trace(load_recipe(RECIPE).recipe, steps=2, kv_tokens=20000, kv_reserve=0.3, max_batch=48)
    sim = simulate(trace, H100_7B_ASSUMED, groups=GROUPS)
    got = {m: [[s["seconds"], s["tokens"], s["counters"].get("retracted_rows", 0)] for s in v] for m, v in sim.items()}
    assert got == RETRACTING_BEFORE


def _recorded() -> list[list]:
    rng = random.Random(1)
    rec = []
    for gi in range(30):
        for j in range(4):
            n = rng.randint(20, 900)
            status = rng.choice(["finished", "finished", "truncated", "running"])
            rec.append([f"g{gi}#{j}", f"g{gi}", 40, n, status, [min(5 * j + rng.randint(0, 30), n) for _ in range(j)]])
    return rec


def test_a_replay_with_shared_prefixes_simulates_as_before():
    rec = _recorded()
    settings = {"steps": 2, "prompts_per_step": 8, "samples_per_prompt": 4, "pool_capacity": 48, "max_staleness": 2,
                "refill": "per_call", "surplus": "train", "token_budget": 6000, "max_new_tokens": 1024,
                "max_batch": 48, "refill_fraction": 0.25, "layout": "server", "kv_tokens": 30000, "kv_reserve": 0.0}
    sim = simulate({"settings": settings, "trajectories": {"sync": rec, "c3po": rec}}, H100_7B_ASSUMED)
    assert {m: [[s["seconds"], s["tokens"]] for s in v] for m, v in sim.items()} == REPLAY_BEFORE


def test_tokens_in_bulk_are_the_tokens_one_at_a_time():
    lengths = Lengths(20000, groups=[[5000] * 4], shared={"p1#1": {"p1#0": 40}})
    for uid in ("p3#1", "p1#1"):  # its own owner throughout; sharing its first 40 with p1#0
        t = Trajectory(uid=uid, prompt_ids=[1], response_ids=[0] * 17)
        bulk = lengths.tokens(t, 300)
        one_by_one = []
        for _ in range(300):
            one_by_one.append(lengths.token(t))
            t.response_ids.append(0)
        assert bulk == one_by_one
