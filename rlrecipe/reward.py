r"""Reward: the one grading path shared by RL rewards, training-time validation and final eval.

A response is graded by taking the content of its last ``\boxed{...}`` and comparing it with the
reference answer(s):

1. Fast path, in the calling process, no math-verify: after light normalisation (``\text{}``
   wrappers, ``$``, spaces, ``\left``/``\right``, ``\dfrac``) the answer equals a reference, or
   both are plain integers (``070 == 70``). This keeps integer-answer RL on tiny tasks cheap.
2. Otherwise math-verify (`parse` + `verify`) decides, in a pool of worker processes with a
   hard time limit per answer. math-verify's own timeouts use ``signal.alarm`` (main thread
   only, whole seconds, and unable to interrupt C code such as a huge integer power), so the
   parent keeps the clock: a worker that runs past the limit is killed (SIGKILL) and replaced,
   and that answer is graded wrong with ``timed_out=True``. A worker that crashes is replaced
   and its answer graded wrong. Nothing a response contains can stall or crash the caller.

Workers are fresh interpreters (``python -c 'from rlrecipe.reward import _worker_main; ...'``)
started with `subprocess`, i.e. spawn semantics: nothing of the parent (torch, CUDA, threads,
the ``__main__`` module) is inherited or re-imported, which a fork or multiprocessing's
spawn/forkserver (both re-import ``__main__``) cannot promise. A worker imports math-verify and
warms it up before it reports ready; see `Grader` for the pool's life cycle.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

CORRECT_REWARD = 5.0
WRONG_REWARD = -5.0
DEFAULT_TIMEOUT = 2.0  # seconds per answer, wall clock, measured from dispatch to a ready worker
_START_TIMEOUT = 120.0  # seconds a new worker may take to import math-verify and report ready
_MAX_START_FAILURES = 3  # consecutive workers dying before ready -> the environment is broken


@dataclass(frozen=True)
class GradeResult:
    extracted: str | None  # content of the last \boxed{...}; None when there is none
    correct: bool
    timed_out: bool = False  # math-verify ran past the time limit (graded wrong)


def reward_of(result: GradeResult, correct_value: float = CORRECT_REWARD,
              wrong_value: float = WRONG_REWARD) -> float:
    """+5 for a correct answer; -5 for a wrong, missing, timed-out or truncated one."""
    return correct_value if result.correct else wrong_value


# -- extraction -----------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.S)  # an escape (\{ \} \\ ...) or a grouping brace
_BARE_TOKEN = re.compile(r"[^\s$]+")
_WS = " \t\r\n"


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed x``.

    None when there is no box, the last box is unbalanced (e.g. a truncated response) or empty.
    Escaped braces ``\{ \}`` do not count. Runs in time linear in ``len(text)``.
    """
    if not text:
        return None
    # Next candidate position for each command, searched backwards; each command's search
    # only ever moves left, so the scan is linear however many false candidates (\fboxsep) occur.
    pos = {cmd: text.rfind(cmd) for cmd in _BOX_COMMANDS}
    while True:
        cmd = max(pos, key=lambda c: pos[c])
        start = pos[cmd]
        if start < 0:
            return None
        j = start + len(cmd)
        if j < len(text) and text[j].isalpha():  # a longer command name, e.g. \fboxsep
            pos[cmd] = text.rfind(cmd, 0, start)
            continue
        break
    k = j
    while k < len(text) and text[k] in _WS:
        k += 1
    if k >= len(text):
        return None
    if text[k] == "{":
        depth = 0
        for m in _BRACE_TOKENS.finditer(text, k):
            tok = m.group()
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                if depth == 0:
                    content = text[k + 1:m.start()].strip()
                    return content or None
        return None  # unbalanced
    if cmd != "\\boxed":
        return None  # \fbox needs braces
    m = _BARE_TOKEN.match(text, k)  # `\boxed 70` / `\boxed5`
    content = m.group().rstrip(".,;:") if m else ""
    return content or None


# -- fast path ------------------------------------------------------------------------------

_WRAPPER = re.compile(r"^\\(?:text|textbf|textrm|mathrm|mathbf|mbox|boxed)\s*\{(.*)\}$", re.S)
_DROP = re.compile(r"\\left|\\right|\\[,;:! ]|\$|\s+")
_INT = re.compile(r"^([+-]?)(\d+)$")


def normalize_answer(s: str) -> str:
    r"""Light, meaning-preserving normalisation used only to decide equality cheaply."""
    s = s.strip()
    for _ in range(4):
        m = _WRAPPER.match(s)
        if not m or not _balanced(m.group(1)):
            break
        s = m.group(1).strip()
    s = _DROP.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _balanced(s: str) -> bool:
    depth = 0
    for m in _BRACE_TOKENS.finditer(s):
        depth += {"{": 1, "}": -1}.get(m.group(), 0)
        if depth < 0:
            return False
    return depth == 0


def _as_int(s: str) -> tuple[str, str] | None:
    """A plain integer as (sign, digits without leading zeros); no int() so no digit limit."""
    m = _INT.match(s)
    if not m:
        return None
    digits = m.group(2).lstrip("0") or "0"
    return ("" if digits == "0" or m.group(1) != "-" else "-", digits)


def fast_grade(extracted: str, answers: list[str]) -> bool | None:
    """True/False when decidable without math-verify; None when math-verify must decide."""
    x = normalize_answer(extracted)
    refs = [normalize_answer(a) for a in answers]
    if x and x in refs:
        return True
    xi = _as_int(x)
    if xi is None:
        return None
    ref_ints = [_as_int(r) for r in refs]
    if any(ri == xi for ri in ref_ints):
        return True
    if all(ri is not None for ri in ref_ints):
        return False
    return None


# -- math-verify (runs inside a worker process) ---------------------------------------------

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


def _grade_with_soft_limit(extracted: str, answers: list[str], soft: float | None) -> tuple[bool, bool]:
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


def _worker_main() -> None:
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
    math_verify_correct("\\frac{1}{2}", ["0.5"])  # warm-up: imports, regex and parser set-up
    out.write('{"ready": true}\n')
    for line in sys.stdin.buffer:
        task = json.loads(line)
        correct, timed_out = _grade_with_soft_limit(task["x"], task["a"], task.get("soft"))
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


# -- the pool -------------------------------------------------------------------------------

class _Worker:
    def __init__(self, mem_mb: int | None):
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["RLRECIPE_GRADER_PARENT"] = str(os.getpid())
        env["RLRECIPE_GRADER_MEM_MB"] = str(mem_mb or 0)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rlrecipe.reward import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None  # task index in flight
        self.deadline = 0.0

    def send(self, payload: bytes) -> None:
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()

    def read_lines(self) -> tuple[list[dict], bool]:
        """Messages available now, and whether the worker's stdout reached EOF."""
        eof = False
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(ln) for ln in lines if ln.strip()], eof

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class Grader:
    """Grades responses against reference answers; a reusable pool of math-verify workers.

    >>> with Grader(timeout=2.0) as g:
    ...     results = g.grade(responses, [[ans] for ans in answers], truncated)

    Workers start lazily, only when an answer misses the fast path, at most `workers` of them
    (default: all usable cores), and stay alive across calls until `close()` (also at exit),
    so RL steps do not pay interpreter start-up again. `start()` pre-starts the whole pool.
    `timeout` is the hard wall-clock limit per answer; a worker also stops itself shortly
    before it (SIGALRM) when the slow part is Python code, which avoids a restart. `mem_mb`
    caps each worker's address space (RLIMIT_AS). `stats` counts what happened.
    `soft_fraction` sets that self-stop at a fraction of `timeout` (None: only the hard kill).
    `workers=0` grades in-process (soft time limit only, main thread only; for debugging).
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, workers: int | None = None,
                 mem_mb: int | None = 4096, soft_fraction: float | None = 0.85):
        if timeout <= 0:
            raise ValueError("timeout must be > 0 seconds")
        self.timeout = float(timeout)
        self.soft_fraction = soft_fraction
        self.max_workers = default_workers() if workers is None else max(0, int(workers))
        self.mem_mb = mem_mb
        self._workers: list[_Worker] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.stats = {"graded": 0, "fast_path": 0, "math_verify": 0, "timeouts": 0,
                      "crashes": 0, "workers_started": 0}
        _LIVE.add(self)

    # -- life cycle
    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        """Kill the workers. The grader stays usable: a later `grade` starts new ones."""
        if os.getpid() != self._pid:  # a forked copy does not own these processes
            self._workers = []
            return
        workers, self._workers = self._workers, []
        for w in workers:
            w.kill()

    def start(self, n: int | None = None) -> None:
        """Start workers now (up to `n`, default all) and wait until they are ready."""
        with self._lock:
            self._own_pool()
            self._grow(self.max_workers if n is None else min(n, self.max_workers))
            self._run_queue({}, deque(), wait_ready=True)

    # -- grading
    def grade(self, responses: list[str], answers: list[list[str]], truncated: list[bool] | None = None,
              *, timeout: float | None = None) -> list[GradeResult]:
        """One GradeResult per response; truncated responses and responses without a box are wrong."""
        if len(answers) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answer lists")
        if truncated is not None and len(truncated) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(truncated)} truncated flags")
        results: list[GradeResult | None] = [None] * len(responses)
        slow: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for i, response in enumerate(responses):
            extracted = extract_boxed(response) if isinstance(response, str) else None
            refs = _as_answer_list(answers[i])
            if extracted is None or (truncated is not None and truncated[i]) or not refs:
                results[i] = GradeResult(extracted, False, False)
                continue
            verdict = fast_grade(extracted, refs)
            if verdict is not None:
                self.stats["fast_path"] += 1
                results[i] = GradeResult(extracted, verdict, False)
                continue
            slow.setdefault((extracted, tuple(refs)), []).append(i)  # duplicates graded once
        if slow:
            verdicts = self._grade_slow(list(slow), self.timeout if timeout is None else float(timeout))
            for (key, idxs), (correct, timed_out) in zip(slow.items(), verdicts, strict=True):
                for i in idxs:
                    results[i] = GradeResult(key[0], correct, timed_out)
        self.stats["graded"] += len(responses)
        return results  # type: ignore[return-value]

    def _grade_slow(self, keys: list[tuple[str, tuple[str, ...]]], timeout: float) -> list[tuple[bool, bool]]:
        self.stats["math_verify"] += len(keys)
        soft = max(0.05, timeout * self.soft_fraction) if self.soft_fraction else None
        if self.max_workers == 0:
            return [_grade_with_soft_limit(x, list(a), soft) for x, a in keys]
        with self._lock:
            self._own_pool()
            self._grow(min(self.max_workers, len(keys)))
            payloads = {i: (json.dumps({"id": i, "x": x, "a": list(a), "soft": soft}) + "\n").encode()
                        for i, (x, a) in enumerate(keys)}
            out: dict[int, tuple[bool, bool]] = {}
            self._run_queue(payloads, deque(range(len(keys))), out, timeout)
        timed_out = sum(1 for _, t in out.values() if t)
        self.stats["timeouts"] += timed_out
        return [out[i] for i in range(len(keys))]

    # -- pool internals (called with the lock held)
    def _own_pool(self) -> None:
        if self._pid != os.getpid():  # we were forked: the workers belong to the parent
            self._workers, self._pid = [], os.getpid()

    def _grow(self, n: int) -> None:
        while len(self._workers) < n:
            self._workers.append(_Worker(self.mem_mb))
            self.stats["workers_started"] += 1

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.mem_mb)
        self.stats["workers_started"] += 1

    def _run_queue(self, payloads: dict[int, bytes], queue: deque, out: dict | None = None,
                   timeout: float = DEFAULT_TIMEOUT, wait_ready: bool = False) -> None:
        """Feed queued tasks to ready workers until all are answered (or, with none, all are ready)."""
        out = {} if out is None else out
        pending = len(queue)
        start_failures = 0
        retried: set[int] = set()
        try:
            while pending > 0 or (wait_ready and not all(w.ready for w in self._workers)):
                now = time.monotonic()
                for w in list(self._workers):
                    if w.ready and w.task is None and queue:
                        i = queue.popleft()
                        try:
                            w.send(payloads[i])
                        except OSError:  # died while idle (or while reading it): retry once elsewhere
                            self.stats["crashes"] += 1
                            self._replace(w)
                            if i in retried:
                                out[i] = (False, False)
                                pending -= 1
                            else:
                                retried.add(i)
                                queue.appendleft(i)
                            continue
                        w.task, w.deadline = i, time.monotonic() + timeout
                # wait for output or the nearest deadline
                deadlines = [w.deadline for w in self._workers if w.task is not None]
                deadlines += [w.started + _START_TIMEOUT for w in self._workers if not w.ready]
                wait = max(0.0, min(deadlines) - now) if deadlines else 0.05
                sel = selectors.DefaultSelector()
                for w in self._workers:
                    if w.task is not None or not w.ready:
                        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
                events = sel.select(timeout=min(wait, 1.0)) if sel.get_map() else []
                sel.close()
                for key, _ in events:
                    w = key.data
                    msgs, eof = w.read_lines()
                    for msg in msgs:
                        if msg.get("ready"):
                            w.ready, start_failures = True, 0
                        elif msg.get("id") == w.task:
                            out[w.task] = (bool(msg["ok"]), bool(msg["to"]))
                            w.task = None
                            pending -= 1
                    if eof:
                        if w.task is not None:  # crashed on this answer: it is wrong
                            out[w.task] = (False, False)
                            pending -= 1
                        elif not w.ready:
                            start_failures += 1
                            if start_failures >= _MAX_START_FAILURES:
                                raise RuntimeError(
                                    "grading workers exit before becoming ready; check that "
                                    f"`{sys.executable} -c 'import math_verify'` works")
                        self.stats["crashes"] += 1
                        self._replace(w)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.task is not None and now >= w.deadline:
                        out[w.task] = (False, True)
                        pending -= 1
                        self._replace(w)
                    elif not w.ready and now >= w.started + _START_TIMEOUT:
                        raise RuntimeError(f"a grading worker did not start within {_START_TIMEOUT:.0f} s")
        except BaseException:
            # Interrupted (Ctrl-C) or broken: busy workers hold abandoned tasks; drop them.
            for w in list(self._workers):
                if w.task is not None or not w.ready:
                    w.kill()
                    self._workers.remove(w)
            raise


_LIVE: weakref.WeakSet[Grader] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for grader in list(_LIVE):
        grader.close()


def _as_answer_list(answers: Any) -> list[str]:
    if answers is None:
        return []
    if isinstance(answers, (str, int, float)):
        answers = [answers]
    return [str(a) for a in answers if a is not None and str(a).strip()]


_default: Grader | None = None
_default_lock = threading.Lock()


def default_grader() -> Grader:
    """The process-wide grader behind `grade_batch` (kept alive; closed at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Grader()
        return _default


def grade_batch(responses: list[str], answers: list[list[str]], truncated: list[bool] | None = None,
                timeout: float = DEFAULT_TIMEOUT) -> list[GradeResult]:
    """`Grader.grade` on the shared default pool."""
    return default_grader().grade(responses, answers, truncated, timeout=timeout)


def grade_trajectories(trajs: list, tokenizer, grader: Grader) -> list[str]:
    """Decode and grade rollouts in place (`correct`, meta `extracted`/`timed_out`); returns the texts.

    The one path RL rewards, training-time validation and evaluation share. A response that did
    not end with eos (truncated, or still running) is wrong.
    """
    from rlrecipe.trajectory import Status

    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    results = grader.grade(texts, [t.answers for t in trajs], [t.status != Status.FINISHED for t in trajs])
    for t, r in zip(trajs, results, strict=True):
        t.correct = r.correct
        t.meta["extracted"] = r.extracted
        t.meta["timed_out"] = r.timed_out
    return texts


# -- `rlrecipe grade` -----------------------------------------------------------------------

def read_grading_rows(file: Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    """(line number, row, answers) for each JSONL row; UserError naming file:line on a bad row."""
    from rlrecipe.errors import UserError

    file = Path(file)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{file}: cannot read: {err}") from None
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if not isinstance(row.get("response"), str):
            raise UserError(f"{where}: missing string field 'response'")
        if "answers" in row:
            refs = row["answers"]
            if not isinstance(refs, list) or not refs or not all(_is_answer(a) for a in refs):
                raise UserError(f"{where}: 'answers' must be a non-empty list of strings")
        elif "answer" in row:
            if not _is_answer(row["answer"]):
                raise UserError(f"{where}: 'answer' must be a string")
            refs = [row["answer"]]
        else:
            raise UserError(f"{where}: missing field 'answer' (or 'answers')")
        if "truncated" in row and not isinstance(row["truncated"], bool):
            raise UserError(f"{where}: 'truncated' must be true or false")
        rows.append((lineno, row, [str(a) for a in refs]))
    return rows


def _is_answer(a: Any) -> bool:
    if isinstance(a, float) and not math.isfinite(a):  # JSON's NaN/Infinity
        return False
    return isinstance(a, (str, int, float)) and not isinstance(a, bool)


def grade_file(file: Path | str, out: Path | str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Path:
    """Grade a JSONL file of `response` + `answer`/`answers` rows; write `<stem>.graded.jsonl`."""
    from rich.console import Console

    from rlrecipe.errors import UserError
    from rlrecipe.runs import atomic_write_text

    if not (0 < timeout < math.inf):  # NaN fails this too
        raise UserError(f"--timeout must be a positive number of seconds, got {timeout}")
    file = Path(file)
    rows = read_grading_rows(file)
    if not rows:
        raise UserError(f"{file}: no rows to grade")
    out = Path(out) if out is not None else file.with_name(file.stem + ".graded.jsonl")
    with Grader(timeout=timeout) as grader:
        results = grader.grade([r["response"] for _, r, _ in rows], [a for _, _, a in rows],
                               [bool(r.get("truncated", False)) for _, r, _ in rows])
    lines = []
    for (_, row, _), res in zip(rows, results, strict=True):
        row = {**row, "extracted": res.extracted, "correct": res.correct, "timed_out": res.timed_out,
               "reward": reward_of(res)}
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(lines))
    except OSError as err:
        raise UserError(f"{out}: cannot write: {err}") from None
    n = len(results)
    correct = sum(r.correct for r in results)
    timeouts = sum(r.timed_out for r in results)
    no_answer = sum(r.extracted is None for r in results)
    acc = f"{100.0 * correct / n:.1f}%" if n else "-"
    Console().print(f"graded [bold]{n}[/] rows: accuracy [bold]{acc}[/] ({correct}/{n}), "
                    f"no answer {no_answer}, timeouts {timeouts} -> {out}", highlight=False, soft_wrap=True)
    return out
