"""The CPU overlap benchmark's arithmetic, on hand-made metrics rows (no timing is asserted)."""

from bench.async_overlap import summarise


def test_step_time_is_rollout_or_wait_plus_train_after_the_first_step():
    sync = [{"rollout_s": 9.0, "train_s": 9.0, "tokens_trained": 1}] + \
        [{"rollout_s": 3.0, "train_s": 2.0, "tokens_trained": 100}] * 3
    s = summarise(sync)
    assert (s["step_s"], s["rollout_s"], s["train_s"], s["wait_s"]) == (5.0, 3.0, 2.0, 3.0)
    assert s["s_per_trained_token"] == 15.0 / 300
    lagged = [{"rollout_s": 9.0, "train_s": 9.0, "tokens_trained": 1}] + \
        [{"rollout_s": 1.0, "rollout_collect_s": 3.0, "train_s": 2.0, "tokens_trained": 100}] * 3
    a = summarise(lagged)
    # collected in 3 s while the previous step trained for 2: the step waits 1 s, then trains 2
    assert (a["step_s"], a["rollout_s"], a["wait_s"]) == (3.0, 3.0, 1.0)
