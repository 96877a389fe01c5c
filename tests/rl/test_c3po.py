
import pytest

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.training import RLSection
from rlrecipe.rl.pool import RolloutPool, within_budget
from rlrecipe.rl.prompts import PromptStream
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def _setup(model_dir, **c3po):
    tok = load_tokenizer(model_dir)
    rows = [{"id": f"p{i}", "prompt": f"Add {i} and {7 * i}.", "answers": [str(8 * i)]} for i in range(50)]
    cfg = RLSection(prompts_per_step=4, samples_per_prompt=3,
                    c3po={"enabled": True, "token_budget": 60, "pool_capacity": 12, "max_staleness": 1, **c3po})
    engine = InProcessEngine(model_dir, tok.eos_token_id, tok.pad_token_id, max_batch=12)
    pool = RolloutPool(cfg, PromptStream(rows, tok, "plain", seed=0))
    # one group is already 30 tokens in (carried over from an earlier step), so it ends first;
    # the untrained model never says eos, so everything else runs to max_new_tokens together
    head = pool.stream.next_group(3)
    engine.generate(head, SamplingParams(max_new_tokens=30), seed=0)
    for t in head:
        t.status = Status.RUNNING
    pool.in_flight = head
    return pool, engine


@pytest.mark.parametrize("surplus", ["carry", "train"])
def test_budget_ends_the_phase_and_unfinished_rollouts_carry_over(tiny_model_dir, surplus):
    """Budget 60: the head group (30 tokens in) ends first, its three rollouts on the same decoding
    step at max_new_tokens = 40, 120 tokens together. surplus: train trains all three; carry
    trains two (the second reaches 60) and keeps the third, finished, to train first next step."""
    pool, engine = _setup(tiny_model_dir, surplus=surplus)
    params = SamplingParams(max_new_tokens=40)
    head = pool.in_flight[0].group_id
    finished, stats = pool.collect(engine, params, seed=1)
    assert all(t.done for t in finished)
    # the group 30 tokens ahead reaches max_new_tokens first; anything else that ended this early
    # ended on eos
    ahead = [t for t in finished + pool.carried if t.group_id == head]
    assert len(ahead) == 3 and all(len(t.response_ids) == 40 and t.status == Status.TRUNCATED for t in ahead)
    assert all(t.response_ids[-1] == engine.eos for t in finished if t.group_id != head)
    if surplus == "carry":
        assert [t.uid for t in finished] == [f"{head}#0", f"{head}#1"] and stats.finished == 2
        assert [t.uid for t in pool.carried] == [f"{head}#2"] and stats.carried == 1
        assert pool.carried[0].age == 1
    else:
        assert sum(len(t.response_ids) for t in finished) >= 60 and pool.carried == [] and stats.carried == 0
    assert stats.pool_size == len(pool.in_flight) > 0
    assert all(t.status == Status.RUNNING and t.age == 1 for t in pool.in_flight)
    assert len(finished) + len(pool.carried) + len(pool.in_flight) <= 12 + 3 * 4  # capacity plus refills
    # groups are sampled n = 3 times from one prompt
    groups = {}
    for t in finished + pool.carried + pool.in_flight:
        groups.setdefault(t.group_id, set()).add(tuple(t.prompt_ids))
    assert all(len(p) == 1 for p in groups.values())
    waiting = list(pool.carried)
    carried = {t.uid: len(t.response_ids) for t in pool.in_flight}
    engine.version = 1
    finished2, stats2 = pool.collect(engine, params, seed=2)
    # the rollout that waited trains first, as it was (no token of version 1)
    assert finished2[:len(waiting)] == waiting and all(set(t.versions) == {0} for t in waiting)
    resumed = [t for t in finished2 if t.uid in carried]
    assert stats2.resumed == len(carried)
    for t in resumed:  # earlier tokens keep version 0, the continuation is version 1
        assert set(t.versions[:carried[t.uid]]) <= {0} and t.versions[-1] == 1
    assert not {t.uid for t in finished} & {t.uid for t in finished2}  # nothing trains twice
    if surplus == "carry":
        # the second step's other rollouts all end together at 40 tokens, 11 x 40 past what it
        # needed: it trains all but one, so that what waits (40) is below the budget
        assert sum(len(t.response_ids) for t in finished2) >= 60
        assert [len(t.response_ids) for t in pool.carried] == [40] and stats2.carried == 1


def test_within_budget_takes_rollouts_in_order_until_the_budget_is_reached():
    trajs = [Trajectory(uid=str(i), prompt_ids=[1], response_ids=[0] * n) for i, n in enumerate([30, 20, 10, 5])]

    def split(budget):
        return [[t.uid for t in part] for part in within_budget(trajs, budget)]

    assert split(40) == [["0", "1"], ["2", "3"]]  # 30 + 20 reaches 40; 15 tokens wait
    assert split(50) == [["0", "1"], ["2", "3"]]
    assert split(51) == [["0", "1", "2"], ["3"]]
    # what waits must hold fewer tokens than the budget: at 12, 30 reaches it, but 35 would wait,
    # so "1" and "2" train as well and only "3" (5 tokens) waits
    assert split(12) == [["0", "1", "2"], ["3"]]
    assert split(5) == [["0", "1", "2", "3"], []]
    assert split(1000) == [["0", "1", "2", "3"], []]


def test_a_carried_rollout_past_max_staleness_is_dropped(tiny_model_dir):
    pool, engine = _setup(tiny_model_dir, max_staleness=0)
    pool.collect(engine, SamplingParams(max_new_tokens=40), seed=1)
    waiting = list(pool.carried)
    assert len(waiting) == 1 and waiting[0].age == 1
    finished, stats = pool.collect(engine, SamplingParams(max_new_tokens=40), seed=2)
    assert waiting[0].status == Status.ABORTED and waiting[0] not in finished
    assert stats.dropped >= 1


@pytest.mark.parametrize("refill", ["per_call", "continuous"])
def test_continuous_refill_starts_a_group_as_soon_as_its_slots_are_free(tiny_model_dir, refill):
    """Omega = 12, n = 3: the head group (30 tokens in) and three fresh groups fill the pool. The
    head group ends 10 tokens later, the others at max_new_tokens (40) another 30 later, which
    crosses the budget of 200. Per call, nothing enters during the call; continuous, a fourth
    group starts in the head group's three slots and is 30 tokens in (its first token, from its
    prefill, is sampled beside the others' 11th) when the budget ends the call: it stays in the
    pool. Never more than Omega in flight."""
    pool, engine = _setup(tiny_model_dir, token_budget=200, refill=refill, surplus="train")
    finished, stats = pool.collect(engine, SamplingParams(max_new_tokens=40), seed=1)
    assert len(finished) == 12 and sum(len(t.response_ids) for t in finished) == 12 * 40
    if refill == "per_call":
        assert pool.stream.cursor == 4 and pool.in_flight == []
    else:
        assert pool.stream.cursor == 5 and len(pool.in_flight) == 3
        assert len({t.group_id for t in pool.in_flight}) == 1
        assert all(t.status == Status.RUNNING and len(t.response_ids) == 30 and t.age == 1 for t in pool.in_flight)
        assert stats.generated_tokens == 3 * 10 + 9 * 40 + 3 * 30  # head: 10 more; the new group counts too


def test_stale_rollouts_are_dropped_and_counted(tiny_model_dir):
    pool, engine = _setup(tiny_model_dir, max_staleness=0)
    params = SamplingParams(max_new_tokens=40)
    pool.collect(engine, params, seed=1)
    stale = sum(t.age > 0 for t in pool.in_flight + pool.carried)
    assert stale > 0
    _, stats = pool.collect(engine, params, seed=2)
    assert stats.dropped == stale and pool.total_dropped == stale


def test_pool_state_round_trips_through_its_checkpoint_file(tiny_model_dir, tmp_path):
    pool, engine = _setup(tiny_model_dir)
    pool.collect(engine, SamplingParams(max_new_tokens=40), seed=1)
    pool.save(tmp_path / "pool.safetensors")
    other, _ = _setup(tiny_model_dir)
    other.load(tmp_path / "pool.safetensors")
    assert other.stream.cursor == pool.stream.cursor
    assert [t.to_dict() for t in other.in_flight] == [t.to_dict() for t in pool.in_flight]
    assert pool.carried and [t.to_dict() for t in other.carried] == [t.to_dict() for t in pool.carried]


def test_synchronous_mode_finishes_every_sample(tiny_model_dir):
    pool, engine = _setup(tiny_model_dir, enabled=False)
    pool.in_flight = []  # the synchronous baseline keeps nothing between steps
    batch, stats = pool.collect(engine, SamplingParams(max_new_tokens=30), seed=1)
    assert len(batch) == 4 * 3 and all(t.done for t in batch) and not pool.in_flight


def test_pool_round_trips_through_its_array_checkpoint(tiny_model_dir, tmp_path):
    pool, engine = _setup(tiny_model_dir)
    pool.collect(engine, SamplingParams(max_new_tokens=40), seed=1)
    assert pool.in_flight and pool.carried  # unfinished rollouts, and one finished past the budget
    pool.save(tmp_path / "pool.safetensors")
    other, _ = _setup(tiny_model_dir)
    other.load(tmp_path / "pool.safetensors")
    assert (other.stream.cursor, other.total_dropped, other.total_resumed) == \
        (pool.stream.cursor, pool.total_dropped, pool.total_resumed)
    # the engine's log-probs are float32 values, so the array form loses nothing
    assert [t.to_dict() for t in other.in_flight] == [t.to_dict() for t in pool.in_flight]
    assert [t.to_dict() for t in other.carried] == [t.to_dict() for t in pool.carried]


def test_prompts_over_max_prompt_tokens_are_left_out_and_counted(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    rows = [{"id": f"p{i}", "prompt": "Add " + " and ".join(["12"] * (1 + 3 * i)) + ".", "answers": ["0"]}
            for i in range(6)]
    lengths = [len(PromptStream([r], tok, "plain", seed=0).next_group(1)[0].prompt_ids) for r in rows]
    assert lengths == sorted(lengths) and len(set(lengths)) == 6
    limit = lengths[2]  # rows 0, 1, 2 fit (a prompt exactly at the limit is kept)
    stream = PromptStream(rows, tok, "plain", seed=0, shuffle=False, max_prompt_tokens=limit)
    assert stream.skipped_too_long == 3
    assert [stream.next_group(1)[0].group_id for _ in range(4)] == ["p0@0", "p1@1", "p2@2", "p0@3"]
    with pytest.raises(UserError, match="data.max_prompt_tokens"):
        PromptStream(rows, tok, "plain", seed=0, max_prompt_tokens=lengths[0] - 1)
