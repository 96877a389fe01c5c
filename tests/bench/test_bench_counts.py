"""What the benchmarks count, checked by hand."""

import torch

from bench.run import generated_tokens


def test_generated_tokens_stop_at_the_first_eos():
    eos, pad = 1, 0
    new = torch.tensor([[5, 6, eos, pad, pad],   # 3: two tokens and the eos
                        [7, eos, 8, eos, pad],   # 2: only the first eos ends it
                        [5, 5, 5, 5, 5],         # 5: no eos, cut at max_new_tokens
                        [eos, pad, pad, pad, pad]])  # 1
    assert generated_tokens(new, eos) == 3 + 2 + 5 + 1


def test_one_thread_comparison_runs_on_one_thread_and_restores_the_count():
    from bench.run import one_thread_speedup

    before = torch.get_num_threads()
    seen = []
    steps = {"packed": lambda: seen.append(torch.get_num_threads()), "padded": lambda: None}
    out = one_thread_speedup(steps, rounds=2)
    assert seen == [1, 1, 1]  # one warm-up call and two rounds, all on one thread
    assert torch.get_num_threads() == before
    assert set(out) == {"packed_speedup_1_thread", "packed_s_per_step_1_thread", "padded_s_per_step_1_thread"}


def test_workers_cpu_time_grows_with_math_verify_work():
    from bench.grading import workers_cpu_s
    from rlrecipe.reward import Grader

    with Grader(timeout=5.0, workers=1) as g:
        assert workers_cpu_s(g) == 0.0  # no worker yet: nothing to count
        g.start()
        (pid,) = g.worker_pids()
        started = workers_cpu_s(g)
        assert started > 0  # the worker's imports and warm-up
        res = g.grade([f"so \\boxed{{{i}\\sqrt{{2}}}}" for i in range(1, 41)],
                      [[f"\\sqrt{{{2 * i * i}}}"] for i in range(1, 41)])
        assert all(r.correct for r in res)
        assert workers_cpu_s(g) > started
    assert g.worker_pids() == []


def test_causal_cells_count_the_pairs_a_causal_mask_keeps():
    from bench.run import causal_cells

    for n in (1, 2, 7, 160):
        assert causal_cells(n) == int(torch.ones(n, n, dtype=torch.bool).tril().sum())
