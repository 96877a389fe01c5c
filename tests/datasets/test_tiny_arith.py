import json
import random

from rlrecipe.data.io import read_jsonl
from rlrecipe.data.tiny_arith import (
    Problem,
    TinyArithConfig,
    generate,
    parse_problem,
    solve,
    teacher_accuracy,
    write_tiny_arith,
)


def test_worked_solution_by_hand():
    text, answer = solve(Problem(start=47, step=18, limit=80))
    assert text == "47,18,80\n47+18=65<80\n65+18=83>80\n\\boxed{83}"
    assert answer == 83 == Problem(47, 18, 80).answer


def test_teacher_forgets_only_carries_of_ten_or_eleven():
    # 45 + 15: units 5 + 5 = 10 -> the teacher may write 50 instead of 60
    p = Problem(45, 15, 55)
    always = solve(p, random.Random(0), forget_prob=1.0)
    assert always == ("45,15,55\n45+15=50<55\n50+15=65>55\n\\boxed{65}", 65) and p.answer == 60
    assert teacher_accuracy(p, 0.6) == 0.4
    # 41 + 15: units 1 + 5 = 6, nothing to forget
    assert solve(Problem(41, 15, 50), random.Random(0), forget_prob=1.0)[1] == 56


def test_deterministic_disjoint_and_consistent(tmp_path):
    cfg = TinyArithConfig(seed=5, n_sft=300, n_rl=300, n_eval=50)
    assert generate(cfg) == generate(cfg)
    assert generate(cfg) != generate(TinyArithConfig(seed=6, n_sft=300, n_rl=300, n_eval=50))
    stats = write_tiny_arith(tmp_path, cfg)
    rl, ev = read_jsonl(tmp_path / "rl.jsonl", "rl"), read_jsonl(tmp_path / "eval.jsonl", "eval")
    sft = read_jsonl(tmp_path / "sft.jsonl", "sft")
    problems = lambda rows, key: {parse_problem(r[key]) for r in rows}  # noqa: E731
    held_out = problems(ev, "problem")
    assert not held_out & problems(rl, "prompt") and not held_out & problems(sft, "prompt")
    for r in rl:
        assert r["answers"] == [str(parse_problem(r["prompt"]).answer)]
    # the teacher is imperfect, and about as imperfect as its exact expected accuracy says
    right = sum(r["response"].endswith(f"{{{parse_problem(r['prompt']).answer}}}") for r in sft) / len(sft)
    assert 0.45 < right < 0.8
    assert abs(stats["teacher_expected_accuracy_eval"] - 0.62) < 0.12
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["rows"] == {"sft": 300, "rl": 300, "eval": 50}


def test_lengths_have_a_long_tail():
    rows = generate(TinyArithConfig(seed=0, n_sft=2000, n_rl=10, n_eval=10))["sft"]
    lengths = sorted(len(r["response"]) for r in rows)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 2 * median
    assert len({len(r["prompt"]) for r in rows}) >= 3  # one length per wording
