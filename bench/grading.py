r"""Grading throughput: answers per second by kind of answer, and `rlrecipe grade FILE` wall time.

`python -m bench.grading` prints both; `make bench` records them in bench/results.json. Each kind
is n distinct answers (all correct but in the last kind):

  integers     \boxed{i}            vs  i
  short        \boxed{\frac{i}{2}}  vs  i/2 written as a decimal (0.5, 1.0, ...)
  math_verify  \boxed{i\sqrt{2}}    vs  \sqrt{2 i^2}: only math-verify can decide these
  math_verify_groups   the same forms as RL meets them: groups of 16 samples of one prompt share
               its reference \sqrt{2 g^2}; sample j answers (g+j)\sqrt{2}, so one in 16 is right and
               no two answers are the same string (the grader grades a repeated one once).
               It runs after math_verify on the same pool, whose answers include all of these:
               math-verify's parse cache holds most of them, so it mostly measures settling
               wrong answers, the costly case for `verify`; the worker's `values_apart` settles
               these (constants far apart) without it

Each kind also records the share of its answers the fast path settled (`<kind>_fast_path_frac`):
all of the first two, none of the math_verify ones.

A fifth measure is real: `boba_cases`, AReaL's 160 model responses to 10 boba rows (16 each,
tests/data/boba_reward_cases.jsonl), graded against the rows' references twice on one started
pool: the first pass pays sympy's first use of each kind of expression in each worker, the
second shows the pool warm (repeated expressions also hit sympy's own cache, so it flatters).

Rates are measured on a started pool (`Grader.start()`); file times are whole `rlrecipe grade`
processes, start-up included. Nothing here asserts a timing: on a shared machine, repeat it, or
run it beside the code it is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlrecipe.reward import Grader

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("integers", "short", "math_verify", "math_verify_groups")
GROUP = 16  # samples_per_prompt of the 7B recipes


def answers(kind: str, n: int) -> tuple[list[str], list[list[str]]]:
    """(responses, reference answers) of one kind."""
    if kind == "integers":
        return [f"so \\boxed{{{i}}}" for i in range(n)], [[str(i)] for i in range(n)]
    if kind == "short":
        return [f"so \\boxed{{\\frac{{{i}}}{{2}}}}" for i in range(n)], [[str(i / 2)] for i in range(n)]
    if kind == "math_verify":
        return ([f"so \\boxed{{{i}\\sqrt{{2}}}}" for i in range(1, n + 1)],
                [[f"\\sqrt{{{2 * i * i}}}"] for i in range(1, n + 1)])
    if kind == "math_verify_groups":
        out: tuple[list[str], list[list[str]]] = ([], [])
        for i in range(n):
            g, j = i // GROUP + 1, i % GROUP
            out[0].append("so \\boxed{" + str(g + j) + "\\sqrt{2}}")
            out[1].append(["\\sqrt{" + str(2 * g * g) + "}"])
        return out
    raise ValueError(f"unknown kind {kind!r}")


def workers_cpu_s(g: Grader) -> float | None:
    """User + system CPU seconds of the grader's live workers so far (Linux /proc; None elsewhere)."""
    total = 0.0
    try:
        for pid in g.worker_pids():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return total


def boba_cases() -> tuple[list[str], list[list[str]]]:
    """AReaL's real responses and the references of their rows (tests/data/README.md)."""
    from rlrecipe.data.convert import convert_file

    data = ROOT / "tests" / "data"
    cases = [json.loads(line) for line in (data / "boba_reward_cases.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = convert_file(data / "boba_rl_rows.jsonl", "rl").rows
    return ([g for c in cases for g in c["generateds"]],
            [r["answers"] for r, c in zip(rows, cases, strict=True) for _ in c["generateds"]])


def rates(n: int = 400, workers: int | None = None) -> dict[str, float]:
    """Answers per second of each kind on a started pool, and the share graded correct."""
    out: dict[str, float] = {}

    def timed(g: Grader, name: str, responses: list[str], refs: list[list[str]]) -> None:
        busy0 = workers_cpu_s(g)
        fast0 = g.stats["fast_path"]
        t0 = time.perf_counter()
        res = g.grade(responses, refs)
        wall = time.perf_counter() - t0
        out[f"{name}_answers_per_s"] = len(responses) / wall
        out[f"{name}_correct_frac"] = sum(r.correct for r in res) / len(responses)
        # the share settled by the fast path, in this process, where math-verify's verdict is certain
        out[f"{name}_fast_path_frac"] = (g.stats["fast_path"] - fast0) / len(responses)
        busy = workers_cpu_s(g)
        if name.startswith("math_verify") and busy is not None and busy0 is not None:
            # CPU the workers spent per answer, and the share of the call's wall time they were busy
            out[f"{name}_worker_cpu_ms"] = 1e3 * (busy - busy0) / len(responses)
            out[f"{name}_workers_busy_share"] = (busy - busy0) / (wall * len(g.worker_pids()))

    with Grader(timeout=2.0, workers=workers) as g:
        g.start()
        for kind in KINDS:
            timed(g, kind, *answers(kind, n))
    with Grader(timeout=2.0, workers=workers) as g:  # a fresh pool: nothing of the above is warm
        g.start()
        real = boba_cases()
        timed(g, "boba_cases_first_pass", *real)
        timed(g, "boba_cases_second_pass", *real)
    return out


def math_verify_cost(kinds: tuple[str, ...] = ("math_verify", "math_verify_groups"), n: int = 400) -> dict[str, float]:
    """Where a math-verify answer's time goes, in this process on one core: parsing the answer,
    parsing the reference (once per distinct reference, as workers cache it), and settling it:
    `values_apart`, then `verify` where that cannot decide (`_settle_ms`), as a worker does, beside
    `verify` alone (`_verify_ms`, what settling cost before `values_apart`). Beside
    `rates`' `<kind>_worker_cpu_ms` (the same work inside the pool, both cores busy) and
    `<kind>_workers_busy_share`, this says whether a slow rate is the pool's or math-verify's.
    The kinds run in `rates`' order, so math-verify's own parse cache is as warm as in the pool's.
    `<kind>_parse_answer_patched_ms` and `_unpatched_ms` parse the same answers again from emptied
    caches, with the workers' latex2sympy patches and without (`rlrecipe.reward.latex_parsing`
    uninstalled): what the patches save, the two sides measured alike."""
    from rlrecipe.reward.answers import extract_boxed
    from rlrecipe.reward.worker import _parse, math_verify_correct, values_apart, verdict

    math_verify_correct("x^2+2x+1", ["(x+1)^2"])  # imports and sympy's first simplification, as a worker's warm-up
    out: dict[str, float] = {}
    for kind in kinds:
        responses, refs = answers(kind, n)
        preds = [extract_boxed(r) for r in responses]
        distinct_refs = list(dict.fromkeys(a for ref in refs for a in ref))
        t0 = time.perf_counter()
        parsed_preds = [_parse(p) for p in preds]
        t1 = time.perf_counter()
        parsed_refs = {a: _parse(a) for a in distinct_refs}
        parse_reference = time.perf_counter() - t1
        pairs = [(parsed_refs[ref[0]], pred) for pred, ref in zip(parsed_preds, refs, strict=True)]

        per = {"parse_answer": (t1 - t0) / n, "parse_reference": parse_reference / n,
               "settle": _timed_loop(verdict, pairs) / n}
        out.update({f"{kind}_{k}_ms": 1e3 * v for k, v in per.items()})
        out[f"{kind}_verify_ms"] = 1e3 * _timed_loop(lambda g, p: verdict(g, p, shortcut=False), pairs) / n
        out[f"{kind}_settled_by_values_apart_frac"] = sum(values_apart(g, p) for g, p in pairs) / n
        out[f"{kind}_one_core_answers_per_s"] = 1 / sum(per.values())
        if kind == "math_verify":  # both from emptied caches, so only the patches differ
            for patched in (True, False):
                name = "patched" if patched else "unpatched"
                out[f"{kind}_parse_answer_{name}_ms"] = 1e3 * _parse_s(preds, patched) / n
    return out


def _parse_s(strings: list[str], patched: bool) -> float:
    """Seconds math-verify's `parse` takes over `strings` from emptied caches, with the workers'
    latex2sympy patches or with latex2sympy's own methods (the patches are installed again after)."""
    from math_verify.parser import parse_latex_cached
    from sympy.core.cache import clear_cache

    from rlrecipe.reward import latex_parsing
    from rlrecipe.reward.worker import _parse

    if not patched:
        latex_parsing.uninstall()
    try:
        parse_latex_cached.cache_clear()
        clear_cache()
        start = time.perf_counter()
        for s in strings:
            _parse(s)
        return time.perf_counter() - start
    finally:
        latex_parsing.install()


def _timed_loop(fn, pairs: list) -> float:
    """Seconds `fn(gold, pred)` takes over all pairs, from an empty sympy cache (whichever of two
    loops over the same pairs ran second would otherwise find the other's results)."""
    from sympy.core.cache import clear_cache

    clear_cache()
    start = time.perf_counter()
    for gold, pred in pairs:
        fn(gold, pred)
    return time.perf_counter() - start


def file_seconds(kind: str, rows: int) -> float:
    """Wall time of `rlrecipe grade FILE` on `rows` answers of one kind."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.jsonl"
        responses, refs = answers(kind, rows)
        path.write_text("".join(json.dumps({"response": r, "answers": a}) + "\n" for r, a in zip(responses, refs, strict=True)))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "grade", str(path)], cwd=ROOT, check=True,
                       capture_output=True)
        return time.perf_counter() - t0


def file_times(sizes: tuple[int, ...] = (160, 800), kinds: tuple[str, ...] = ("short", "math_verify")) -> dict:
    return {f"grade_file_{kind}_{rows}_rows_s": file_seconds(kind, rows) for kind in kinds for rows in sizes}


def grading_bench() -> dict[str, float]:
    """Everything `make bench` records for grading."""
    return {**rates(), **math_verify_cost(), **file_times()}


def main() -> None:
    results = grading_bench()
    table = Table(title="grading (one run; repeat on a shared machine)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in results.items():
        table.add_row(key, f"{value:.3f}" if value < 10 else f"{value:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
