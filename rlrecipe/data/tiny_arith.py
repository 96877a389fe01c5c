"""tiny-arith: a synthetic boxed-answer task that tells the story of distillation, then RL.

Column addition, one line per column from the right (`da+db+carry=sum`), ending in
`\\boxed{a+b}`. The SFT "teacher" has a systematic bug: when the previous column summed to
10 or 11 it forgets the carry with probability `forget_prob`. A model distilled from it
inherits the bug (SFT plateaus near the teacher); only a verifiable reward can take it past.

Operand lengths have a long tail, so response lengths do too (what C3PO++ is for), and the
prompt phrasing varies, so prompts have different lengths as well.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from rlrecipe.runs import atomic_write_text

PHRASINGS = ["Add {a} and {b}.", "What is {a} + {b}?", "Compute {a}+{b}.", "Find the sum of {a} and {b}."]
# P(number of digits = 1..8): most problems are short, a few are long.
LENGTH_WEIGHTS = [0.10, 0.22, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03]
FORGETFUL_SUMS = (10, 11)


@dataclass(frozen=True)
class TinyArithConfig:
    seed: int = 0
    n_sft: int = 4000
    n_rl: int = 4000
    n_eval: int = 200
    forget_prob: float = 0.6


def _number(rng: random.Random) -> int:
    length = rng.choices(range(1, len(LENGTH_WEIGHTS) + 1), weights=LENGTH_WEIGHTS)[0]
    if length == 1:
        return rng.randrange(0, 10)
    return rng.randrange(10 ** (length - 1), 10**length)


def columns(a: int, b: int) -> list[tuple[int, int]]:
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    return [(int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0) for i in range(width)]


def solve(a: int, b: int, rng: random.Random | None = None, forget_prob: float = 0.0) -> tuple[str, int]:
    """The worked solution and the answer it reaches. With `rng`, the teacher may forget carries."""
    lines, digits, carry, prev_sum = [], [], 0, None
    for da, db in columns(a, b):
        if carry and prev_sum in FORGETFUL_SUMS and rng is not None and rng.random() < forget_prob:
            carry = 0
        s = da + db + carry
        lines.append(f"{da}+{db}+{carry}={s}")
        digits.append(s % 10)
        carry, prev_sum = s // 10, s
    answer = int(("1" if carry else "") + "".join(str(d) for d in reversed(digits)))
    return "\n".join(lines) + f"\n\\boxed{{{answer}}}", answer


def teacher_accuracy(a: int, b: int, forget_prob: float) -> float:
    """Exact probability that the teacher's solution is right: no forgotten carry on the way."""
    events, carry, prev_sum = 0, 0, None
    for da, db in columns(a, b):
        if carry and prev_sum in FORGETFUL_SUMS:
            events += 1
        s = da + db + carry
        carry, prev_sum = s // 10, s
    return (1.0 - forget_prob) ** events


def _problems(rng: random.Random, count: int, taken: set) -> list[tuple[int, int]]:
    out = []
    while len(out) < count:
        pair = (_number(rng), _number(rng))
        if pair in taken:
            continue
        taken.add(pair)
        out.append(pair)
    return out


def generate(cfg: TinyArithConfig) -> dict[str, list[dict]]:
    rng = random.Random(cfg.seed)
    taken: set = set()
    # Eval first, so growing the training sets never changes the held-out problems.
    eval_pairs = _problems(rng, cfg.n_eval, taken)
    sft_pairs = _problems(rng, cfg.n_sft, taken)
    rl_pairs = _problems(rng, cfg.n_rl, taken)

    def prompt(a: int, b: int) -> str:
        return rng.choice(PHRASINGS).format(a=a, b=b)

    sft = []
    for i, (a, b) in enumerate(sft_pairs):
        response, _ = solve(a, b, rng, cfg.forget_prob)
        sft.append({"id": f"sft-{i}", "prompt": prompt(a, b), "response": response})
    rl = [{"id": f"rl-{i}", "prompt": prompt(a, b), "answers": [str(a + b)]} for i, (a, b) in enumerate(rl_pairs)]
    ev = [{"id": f"eval-{i}", "problem": prompt(a, b), "answer": str(a + b),
           "teacher_accuracy": teacher_accuracy(a, b, cfg.forget_prob)} for i, (a, b) in enumerate(eval_pairs)]
    return {"sft": sft, "rl": rl, "eval": ev}


def write_tiny_arith(out_dir: str | Path, cfg: TinyArithConfig) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = generate(cfg)
    for kind, rows in splits.items():
        atomic_write_text(out_dir / f"{kind}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    sft_correct = sum(
        r["response"].endswith(f"\\boxed{{{_true_sum(r['prompt'])}}}") for r in splits["sft"]
    ) / max(1, len(splits["sft"]))
    teacher_eval = sum(r["teacher_accuracy"] for r in splits["eval"]) / max(1, len(splits["eval"]))
    stats = {
        "config": asdict(cfg),
        "rows": {k: len(v) for k, v in splits.items()},
        "sft_responses_correct": round(sft_correct, 4),
        "teacher_expected_accuracy_eval": round(teacher_eval, 4),
    }
    atomic_write_text(out_dir / "meta.json", json.dumps(stats, indent=2))
    return stats


def _true_sum(prompt: str) -> int:
    import re

    a, b = (int(x) for x in re.findall(r"\d+", prompt))
    return a + b
