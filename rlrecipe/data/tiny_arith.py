"""tiny-arith: a synthetic boxed-answer task that tells the story of distillation, then RL.

"From 47 add 18 until above 80." The worked solution copies the givens (`47,18,80`), then
writes one line per addition with its comparison (`47+18=65<80`, `65+18=83>80`) and ends with
`\\boxed{83}`. Every value has two digits and every step is 11..19, so all lines have one shape
and each reads only the line above it (copy, add, compare): a model of under a million
parameters learns it in minutes on a CPU.

The SFT "teacher" has a systematic bug: when the units digits of a line sum to 10 or 11 it
forgets the carry with probability `forget_prob`, and carries the wrong value forward (which
always ends at a wrong answer). A model distilled from it inherits the bug, so SFT plateaus
near the teacher; only a verifiable reward takes it past. The number of lines has a long
tail, so response lengths do too (what C3PO++ is for); prompts differ in wording and length.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rlrecipe.core.atomic_io import atomic_write_text

# Short on purpose: on a CPU, prompt tokens are most of what training computes.
PHRASINGS = [
    "From {start} add {step} until above {limit}.",
    "Start {start}, step {step}, first above {limit}?",
    "Count from {start} by {step} past {limit}.",
]
# P(number of lines = 1, 2, ...): most problems are short, a few are long.
LINE_WEIGHTS = [0.20, 0.18, 0.15, 0.13, 0.11, 0.09, 0.08, 0.06]
FORGETFUL_UNITS = (10, 11)


@dataclass(frozen=True)
class TinyArithConfig:
    seed: int = 0
    n_sft: int = 20000
    n_rl: int = 4000
    n_eval: int = 200
    forget_prob: float = 0.8
    max_lines: int = len(LINE_WEIGHTS)
    phrasings: int = len(PHRASINGS)  # how many of PHRASINGS prompts use


@dataclass(frozen=True)
class Problem:
    start: int
    step: int
    limit: int

    @property
    def answer(self) -> int:
        return self.start + self.step * ((self.limit - self.start) // self.step + 1)


def add_line(value: int, step: int, rng: random.Random | None, forget_prob: float) -> int:
    """One addition of the teacher's; with `rng` it may forget the units carry."""
    if value % 10 + step % 10 in FORGETFUL_UNITS and rng is not None and rng.random() < forget_prob:
        return value + step - 10
    return value + step


def solve(p: Problem, rng: random.Random | None = None, forget_prob: float = 0.0) -> tuple[str, int]:
    """The worked solution and the answer it reaches. With `rng`, the teacher may forget carries."""
    # the first line copies the givens; after it, every line reads only the line above it
    lines, value = [f"{p.start},{p.step},{p.limit}"], p.start
    while value <= p.limit:
        new = add_line(value, p.step, rng, forget_prob)
        # the limit rides along on every line, so the stopping test is local too
        lines.append(f"{value}+{p.step}={new}{'>' if new > p.limit else '<'}{p.limit}")
        value = new
    return "\n".join(lines) + f"\n\\boxed{{{value}}}", value


def teacher_accuracy(p: Problem, forget_prob: float) -> float:
    """Exact probability that the teacher's solution is right: no forgotten carry on the way."""
    events, value = 0, p.start
    while value <= p.limit:
        events += (value % 10 + p.step % 10) in FORGETFUL_UNITS
        value += p.step
    return (1.0 - forget_prob) ** events


def parse_problem(prompt: str) -> Problem:
    start, step, limit = (int(x) for x in re.findall(r"\d+", prompt))
    return Problem(start, step, limit)


def _problem(rng: random.Random, max_lines: int) -> Problem:
    lines = rng.choices(range(1, max_lines + 1), weights=LINE_WEIGHTS[:max_lines])[0]
    # every value stays in 10..99 and every step in 11..19, so all lines have one shape (and a
    # forgotten carry still moves forward: the teacher's loop always ends)
    step = rng.randrange(11, min(19, 89 // lines) + 1)
    start = rng.randrange(10, 99 - lines * step + 1)
    limit = rng.randrange(start + (lines - 1) * step, start + lines * step)
    return Problem(start, step, limit)


def _problems(rng: random.Random, count: int, taken: set, max_lines: int) -> list[Problem]:
    out = []
    while len(out) < count:
        p = _problem(rng, max_lines)
        if p in taken:
            continue
        taken.add(p)
        out.append(p)
    return out


def generate(cfg: TinyArithConfig) -> dict[str, list[dict]]:
    rng = random.Random(cfg.seed)
    taken: set = set()
    # Eval first, so growing the training sets never changes the held-out problems.
    eval_p = _problems(rng, cfg.n_eval, taken, cfg.max_lines)
    sft_p = _problems(rng, cfg.n_sft, taken, cfg.max_lines)
    rl_p = _problems(rng, cfg.n_rl, taken, cfg.max_lines)

    def prompt(p: Problem) -> str:
        return rng.choice(PHRASINGS[: cfg.phrasings]).format(start=p.start, step=p.step, limit=p.limit)

    sft = []
    for i, p in enumerate(sft_p):
        response, _ = solve(p, rng, cfg.forget_prob)
        sft.append({"id": f"sft-{i}", "prompt": prompt(p), "response": response})
    rl = [{"id": f"rl-{i}", "prompt": prompt(p), "answers": [str(p.answer)]} for i, p in enumerate(rl_p)]
    ev = [{"id": f"eval-{i}", "problem": prompt(p), "answer": str(p.answer),
           "teacher_accuracy": teacher_accuracy(p, cfg.forget_prob)} for i, p in enumerate(eval_p)]
    return {"sft": sft, "rl": rl, "eval": ev}


def write_tiny_arith(out_dir: str | Path, cfg: TinyArithConfig) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = generate(cfg)
    for kind, rows in splits.items():
        atomic_write_text(out_dir / f"{kind}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    sft_correct = sum(r["response"].endswith(f"\\boxed{{{parse_problem(r['prompt']).answer}}}")
                      for r in splits["sft"]) / max(1, len(splits["sft"]))
    teacher_eval = sum(r["teacher_accuracy"] for r in splits["eval"]) / max(1, len(splits["eval"]))
    stats = {
        "config": asdict(cfg),
        "rows": {k: len(v) for k, v in splits.items()},
        "sft_responses_correct": round(sft_correct, 4),
        "teacher_expected_accuracy_eval": round(teacher_eval, 4),
    }
    atomic_write_text(out_dir / "meta.json", json.dumps(stats, indent=2))
    return stats
