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
    text, answer = solve(Problem(start=347, step=58, limit=460))
    assert text == "347,58,460\n347+58=405<460\n405+58=463>460\n\\boxed{463}"
    assert answer == 463 == Problem(347, 58, 460).answer


def test_teacher_forgets_only_carries_of_ten_or_eleven():
    # 345 + 65: units 5 + 5 = 10 -> the teacher may write 400 instead of 410
    p = Problem(345, 65, 400)
    always = solve(p, random.Random(0), forget_prob=1.0)
    assert always == ("345,65,400\n345+65=400<400\n400+65=465>400\n\\boxed{465}", 465) and p.answer == 410
    assert teacher_accuracy(p, 0.6) == 0.4
    # 341 + 65: units 1 + 5 = 6, nothing to forget
    assert solve(Problem(341, 65, 400), random.Random(0), forget_prob=1.0)[1] == 406


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
    assert abs(stats["teacher_expected_accuracy_eval"] - 0.62) < 0.1
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["rows"] == {"sft": 300, "rl": 300, "eval": 50}


def test_lengths_have_a_long_tail():
    rows = generate(TinyArithConfig(seed=0, n_sft=2000, n_rl=10, n_eval=10))["sft"]
    lines = sorted(r["response"].count("\n") for r in rows)
    median, longest = lines[len(lines) // 2], lines[-1]
    assert longest >= 3 * median
    assert len({len(r["prompt"]) for r in rows}) >= 3  # one length per wording
