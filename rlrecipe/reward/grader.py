r"""The grader pool: the fast path in the calling process, math-verify in worker processes.

math-verify's own timeouts use ``signal.alarm`` (main thread only, whole seconds, and unable to
interrupt C code such as a huge integer power), so the parent keeps the clock: a worker that runs
past the limit is killed (SIGKILL) and replaced, and that answer is graded wrong with
``timed_out=True``. A worker that crashes is replaced and its answer graded wrong. Nothing a
response contains can stall or crash the caller.

Workers are fresh interpreters (``python -c 'from rlrecipe.reward.worker import main; main()'``)
started with `subprocess`, i.e. spawn semantics: nothing of the parent (torch, CUDA, threads,
the ``__main__`` module) is inherited or re-imported, which a fork or multiprocessing's
spawn/forkserver (both re-import ``__main__``) cannot promise. A worker imports math-verify and
warms it up before it reports ready; see `Grader` for the pool's life cycle.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrecipe.reward.answers import answer_list, extract_boxed, fast_grade
from rlrecipe.reward.worker import grade_with_soft_limit

DEFAULT_TIMEOUT = 2.0  # seconds per answer, wall clock, measured from dispatch to a ready worker
_START_TIMEOUT = 120.0  # seconds a new worker may take to import math-verify and report ready
_MAX_START_FAILURES = 3  # consecutive workers dying before ready -> the environment is broken
_WORKER_ENTRY = "from rlrecipe.reward.worker import main; main()"


@dataclass(frozen=True)
class GradeResult:
    extracted: str | None  # content of the last \boxed{...}; None when there is none
    correct: bool
    timed_out: bool = False  # math-verify ran past the time limit (graded wrong)


def reward_of(result: GradeResult, correct_value: float, wrong_value: float) -> float:
    """The recipe's reward (`rl.reward_correct` / `rl.reward_wrong`) for one graded answer.

    Wrong, missing, timed-out and truncated answers all earn `wrong_value`.
    """
    return correct_value if result.correct else wrong_value


# -- the pool -------------------------------------------------------------------------------

class _Worker:
    def __init__(self, mem_mb: int | None):
        root = str(Path(__file__).resolve().parents[2])  # the directory holding `rlrecipe/`
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["RLRECIPE_GRADER_PARENT"] = str(os.getpid())
        env["RLRECIPE_GRADER_MEM_MB"] = str(mem_mb or 0)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_ENTRY],
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
            refs = answer_list(answers[i])
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
            return [grade_with_soft_limit(x, list(a), soft) for x, a in keys]
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
