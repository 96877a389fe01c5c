"""The math-verify side of grading: what a worker process runs.

A worker is a fresh interpreter started by the grader pool (`rlrecipe.reward.grader`) with
``python -c 'from rlrecipe.reward.worker import main; main()'``. It reads one task per JSON line
on stdin, answers each with one JSON line on stdout, in order, and exits with its parent.
math-verify's own timeouts are disabled: a worker stops Python-level work itself (SIGALRM,
`soft` seconds), and the parent kills a worker that runs past the hard limit.
"""

from __future__ import annotations

import json
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


def math_verify_correct(extracted: str, answers: list[str]) -> bool:
    """math-verify's verdict, in this process and without any time limit (workers add one)."""
    _, verify, _ = _mv()
    pred = _parse(extracted)
    if not pred:
        return False
    for answer in answers:
        gold = _parse_gold(answer)
        if gold and verify(gold, pred, timeout_seconds=None):
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
    out.write('{"ready": true}\n')
    for line in sys.stdin.buffer:
        task = json.loads(line)
        correct, timed_out = grade_with_soft_limit(task["x"], task["a"], task.get("soft"))
        out.write(json.dumps({"id": task["id"], "ok": correct, "to": timed_out}) + "\n")


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
