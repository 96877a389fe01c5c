"""The math-verify side of grading: what a worker process runs.

A worker is a fresh interpreter started by the grader pool (`rlrecipe.reward.grader`) with
``python -c 'from rlrecipe.reward.worker import main; main()'``. It reads one task per JSON line
on stdin, answers each with one JSON line on stdout, in order, and exits with its parent.
math-verify's own timeouts are disabled: a worker stops Python-level work itself (SIGALRM,
`soft` seconds), and the parent kills a worker that runs past the hard limit.

Before `verify`, `values_apart` settles the commonest costly case, a wrong answer whose value and
the reference's are plain constants far apart (``18`` against ``9\\sqrt{2}``): `verify` would
simplify their difference symbolically (about 3.5 ms) before calling them different; comparing
their values to 30 digits takes about 0.1 ms and reaches the same verdict. Parsing itself is
made faster, with the same results, by `rlrecipe.reward.latex_parsing`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from functools import lru_cache

# Run before a worker reports ready: imports, regexes and parser set-up, and sympy's first
# symbolic simplification (about a second, several on a busy machine), which would otherwise
# come out of the time limit of the first such answer and could turn a correct one wrong.
_WARM_UP = [("\\frac{1}{2}", ["0.5"]), ("x^2+2x+1", ["(x+1)^2"])]


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a worker; a BaseException so math-verify's `except Exception` misses it."""


@lru_cache(maxsize=1)
def _mv():
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    from rlrecipe.reward.latex_parsing import install

    install()  # the same parses, faster (integer literals, two-stage ANTLR prediction)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # timeouts are ours to report
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, config


def _parse(s: str) -> list:
    parse, _, config = _mv()
    text = s if "\\boxed" in s else "\\boxed{" + s + "}"
    # Timeouts disabled inside math-verify: the worker's own itimer and the parent's kill rule.
    return parse(text, extraction_config=config, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list:
    return _parse(answer)


# Two constants this far apart, relative to the larger (and at least absolutely), are different to
# every comparison `verify` makes: its float comparison rounds to 6 decimals, its exact one
# evaluates the difference to 15 digits, and symbolic simplification keeps the value.
_APART = 1e-5


def _constant_value(expr) -> float | None:
    """The value of a parsed answer that is a real constant (no variable, set, relation, matrix,
    percentage or other unevaluated part); None for anything else or beyond a float's range.
    Evaluated to 30 digits by sympy, then rounded to a float: at a relative margin of 1e-5, a
    float's rounding (1e-16) cannot turn "equal" into "apart"."""
    from sympy import Expr, UnevaluatedExpr
    from sympy.matrices import MatrixBase
    from sympy.matrices.expressions import MatrixExpr

    if (not isinstance(expr, Expr) or isinstance(expr, (MatrixBase, MatrixExpr)) or expr.free_symbols
            or expr.has(UnevaluatedExpr)):  # latex2sympy writes 50\% as 50*UnevaluatedExpr(1/100)
        return None
    value = expr.evalf(30)
    if not (value.is_Float or value.is_Rational):  # complex, infinite, nan, or not a number after all
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def values_apart(gold: list, pred: list) -> bool:
    """True when math-verify's `verify(gold, pred)` is certainly False because every pair of
    parsed expressions are real constants whose values are far apart, and no pair of the raw
    strings (which `verify` also compares) is equal. False means: let `verify` decide."""
    golds = [g for g in gold if not isinstance(g, str)]
    preds = [p for p in pred if not isinstance(p, str)]
    if not golds or not preds or any(g.strip() == p.strip() for g in gold if isinstance(g, str)
                                     for p in pred if isinstance(p, str)):
        return False
    gold_values = [_constant_value(g) for g in golds]
    pred_values = [_constant_value(p) for p in preds]
    return all(a is not None and b is not None and abs(a - b) > _APART * max(1.0, abs(a), abs(b))
               for a in gold_values for b in pred_values)


def verdict(gold: list, pred: list, shortcut: bool = True) -> bool:
    """Whether a parsed answer equals one parsed reference: `values_apart`, else `verify`.
    `shortcut=False` leaves out `values_apart`, so tests and benchmarks can compare the two."""
    if shortcut and values_apart(gold, pred):
        return False
    return bool(_mv()[1](gold, pred, timeout_seconds=None))


def math_verify_correct(extracted: str, answers: list[str], shortcut: bool = True) -> bool:
    """math-verify's verdict, in this process and without any time limit (workers add one)."""
    pred = _parse(extracted)
    if not pred:
        return False
    for answer in answers:
        gold = _parse_gold(answer)
        if gold and verdict(gold, pred, shortcut):
            return True
    return False


def grade_with_soft_limit(extracted: str, answers: list[str], soft: float | None) -> tuple[bool, bool]:
    """(correct, timed_out); `soft` arms SIGALRM (main thread only) to stop Python-level work."""
    if not soft or threading.current_thread() is not threading.main_thread():
        try:
            return math_verify_correct(extracted, answers), False
        except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
            return False, False

    def on_alarm(signum, frame):
        raise _SoftTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, soft)
    try:
        return math_verify_correct(extracted, answers), False
    except _SoftTimeout:
        return False, True
    except Exception:  # noqa: BLE001 - includes RecursionError, MemoryError
        return False, False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def main() -> None:
    """Worker loop: JSON lines in on stdin, JSON lines out on a private copy of stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    parent = int(os.environ.get("RLRECIPE_GRADER_PARENT", "0"))
    _die_with_parent(parent)
    try:
        import resource

        limit = int(os.environ.get("RLRECIPE_GRADER_MEM_MB", "0"))
        if limit > 0:
            resource.setrlimit(resource.RLIMIT_AS, (limit << 20, limit << 20))
    except (ImportError, ValueError, OSError):
        pass
    for extracted, answers in _WARM_UP:
        math_verify_correct(extracted, answers)
    _freeze_heap()
    out.write('{"ready": true}\n')
    for line in sys.stdin.buffer:
        task = json.loads(line)
        correct, timed_out = grade_with_soft_limit(task["x"], task["a"], task.get("soft"))
        out.write(json.dumps({"id": task["id"], "ok": correct, "to": timed_out}) + "\n")


def _freeze_heap() -> None:
    """Leave what the imports and the warm-up made (about 100,000 objects: sympy, ANTLR's tables,
    math-verify) out of the cyclic garbage collector's passes. Each full pass walked all of them
    (about 45 ms, once every few hundred answers) to find none to free; they live as long as the
    worker does. Objects made while grading are collected as before; no verdict depends on it."""
    import gc

    gc.collect()
    gc.freeze()


def _die_with_parent(parent: int) -> None:
    """Exit when the parent dies, even while busy: PDEATHSIG on Linux plus a polling thread."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if parent and os.getppid() != parent:
                os._exit(0)
            time.sleep(0.5)

    if parent and os.getppid() != parent:
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()
