r"""The grader pool: the fast path in the calling process, math-verify in worker processes.

math-verify's own timeouts use ``signal.alarm`` (main thread only, whole seconds, and unable to
interrupt C code such as a huge integer power), so the parent keeps the clock: a worker that runs
past the limit is killed (SIGKILL) and replaced, and that answer is graded wrong with
``timed_out=True``. A worker that crashes is replaced and its answer graded wrong. Nothing a
response contains can stall or crash the caller.

Each worker holds a short queue of tasks (up to `_MAX_DEPTH`, refilled in one write when half
empty), so it goes on to its next answer without waiting for the parent; the time limit of an
answer starts when the worker is free to start it (the answer before it came back). When a
worker is killed or dies, the answer it was on is graded wrong and the ones queued behind it go
to another worker.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrecipe.reward.answers import answer_list, extract_boxed, fast_grade
from rlrecipe.reward.worker import grade_with_soft_limit

DEFAULT_TIMEOUT = 2.0  # seconds per answer, wall clock, from when a ready worker is free to start it
_START_TIMEOUT = 120.0  # seconds a new worker may take to import math-verify and report ready
_MAX_START_FAILURES = 3  # consecutive workers dying before ready -> the environment is broken
_WORKER_ENTRY = "from rlrecipe.reward.worker import main; main()"
# Tasks queued in one worker at a time: a worker never waits for its next task (a message round
# trip through a busy parent), while the end of a call stays balanced between workers.
_MAX_DEPTH = 16


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

GRADER_HASH_SEED = "0"


class _Worker:
    """One worker process, and the tasks sent to it that it has not answered yet (in order)."""

    def __init__(self, mem_mb: int | None):
        root = str(Path(__file__).resolve().parents[2])  # the directory holding `rlrecipe/`
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["RLRECIPE_GRADER_PARENT"] = str(os.getpid())
        env["RLRECIPE_GRADER_MEM_MB"] = str(mem_mb or 0)
        env.setdefault("OMP_NUM_THREADS", "1")
        # math-verify's verdict on a few pairs depends on Python's string hashing (sympy orders terms
        # by hash): `\infty\infty` against 1/2 is wrong under one hash seed and right under another.
        # One fixed seed makes the reward a function of the answer alone, the same in every run.
        env["PYTHONHASHSEED"] = GRADER_HASH_SEED
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_ENTRY],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.queued: deque[int] = deque()  # task indices sent and not answered; the first is running
        self.queued_bytes = 0
        self.deadline = 0.0  # for the first queued task
        # Sending never blocks while the worker is busy: what is queued stays within half the
        # pipe, so a hung worker cannot stall the parent (which must keep the clock).
        self.pipe_budget = _pipe_size(self.proc.stdin.fileno()) // 2

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


def _pipe_size(fd: int) -> int:
    try:
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except (ImportError, AttributeError, OSError):  # not Linux: POSIX promises at least this much
        return 4096


@dataclass
class _Batch:
    """One call's tasks: payloads by index, those not yet sent, and the verdicts so far."""

    payloads: dict[int, bytes]
    todo: deque[int]
    out: dict[int, tuple[bool, bool]]
    timeout: float
    depth: int  # tasks queued per worker at most
    retried: set[int] = field(default_factory=set)
    start_failures: int = 0

    @property
    def pending(self) -> int:
        return len(self.payloads) - len(self.out)


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
            self._run(_Batch({}, deque(), {}, self.timeout, 1), wait_ready=True)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for measuring them: `make bench` reads their CPU time)."""
        return [w.proc.pid for w in self._workers]

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
            depth = max(1, min(_MAX_DEPTH, len(keys) // (8 * len(self._workers))))
            batch = _Batch(payloads, deque(range(len(keys))), {}, timeout, depth)
            # wait_ready: a worker started for this call and not needed in the end (the others
            # answered first) would otherwise go on importing math-verify (about a core-second)
            # after grade() returned, in the time of whatever runs next: an RL step's training
            self._run(batch, wait_ready=True)
        self.stats["timeouts"] += sum(1 for _, t in batch.out.values() if t)
        return [batch.out[i] for i in range(len(keys))]

    # -- pool internals (called with the lock held)
    def _own_pool(self) -> None:
        if self._pid != os.getpid():  # we were forked: the workers belong to the parent
            self._workers, self._pid = [], os.getpid()

    def _grow(self, n: int) -> None:
        while len(self._workers) < n:
            self._workers.append(_Worker(self.mem_mb))
            self.stats["workers_started"] += 1

    def _run(self, batch: _Batch, wait_ready: bool = False) -> None:
        """Feed the batch's tasks to ready workers until all are answered (or, with none, all are ready).

        Each worker holds up to `batch.depth` tasks and answers them in order; the time limit
        runs for its first one, from when the worker is free to start it.
        """
        try:
            while batch.pending > 0 or (wait_ready and not all(w.ready for w in self._workers)):
                for w in list(self._workers):
                    self._feed(w, batch)
                if batch.pending == 0 and not wait_ready:
                    break  # the last tasks were settled while feeding (a worker gone twice)
                self._wait_for_output(batch)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.queued and now >= w.deadline:
                        self._retire(w, batch, timed_out=True)
                    elif not w.ready and now >= w.started + _START_TIMEOUT:
                        raise RuntimeError(f"a grading worker did not start within {_START_TIMEOUT:.0f} s")
        except BaseException:
            # Interrupted (Ctrl-C) or broken: busy workers hold abandoned tasks; drop them.
            for w in list(self._workers):
                if w.queued or not w.ready:
                    w.kill()
                    self._workers.remove(w)
            raise

    def _feed(self, w: _Worker, batch: _Batch) -> None:
        """Top up a ready worker's queue (once it is half empty) with one write."""
        if not w.ready or not batch.todo or len(w.queued) > batch.depth // 2:
            return
        chunk, size = [], 0
        while batch.todo and len(w.queued) + len(chunk) < batch.depth:
            n = len(batch.payloads[batch.todo[0]])
            if (w.queued or chunk) and w.queued_bytes + size + n > w.pipe_budget:
                break  # an idle worker takes any one task: it reads while we write
            chunk.append(batch.todo.popleft())
            size += n
        if not chunk:
            return
        try:
            w.send(b"".join(batch.payloads[i] for i in chunk))
        except OSError:  # it died (while idle, or on a queued task): retry these once elsewhere
            for i in reversed(chunk):
                if i in batch.retried:
                    batch.out[i] = (False, False)
                else:
                    batch.retried.add(i)
                    batch.todo.appendleft(i)
            self._collect(w, batch)  # answers it gave before dying still count
            self.stats["crashes"] += 1
            self._retire(w, batch, timed_out=False)
            return
        if not w.queued:
            w.deadline = time.monotonic() + batch.timeout
        w.queued.extend(chunk)
        w.queued_bytes += size

    def _wait_for_output(self, batch: _Batch) -> None:
        """Read what workers say until the nearest deadline (at most 1 s); handle exits."""
        busy = [w for w in self._workers if w.queued or not w.ready]
        if not busy:
            return
        deadlines = [w.deadline if w.queued else w.started + _START_TIMEOUT for w in busy]
        wait = min(max(0.0, min(deadlines) - time.monotonic()), 1.0)
        with selectors.DefaultSelector() as sel:
            for w in busy:
                sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            events = sel.select(timeout=wait)
        for key, _ in events:
            w = key.data
            if not self._collect(w, batch):
                continue
            # exited: on a task (that answer is wrong), while idle, or before it was ready
            if not w.ready:
                batch.start_failures += 1
                if batch.start_failures >= _MAX_START_FAILURES:
                    raise RuntimeError(
                        "grading workers exit before becoming ready; check that "
                        f"`{sys.executable} -c 'import math_verify'` works")
            self.stats["crashes"] += 1
            self._retire(w, batch, timed_out=False)

    def _collect(self, w: _Worker, batch: _Batch) -> bool:
        """Take the worker's messages; True when its output has ended (it exited)."""
        msgs, eof = w.read_lines()
        for msg in msgs:
            if msg.get("ready"):
                w.ready, batch.start_failures = True, 0
            elif w.queued and msg.get("id") == w.queued[0]:
                i = w.queued.popleft()
                w.queued_bytes -= len(batch.payloads[i])
                batch.out[i] = (bool(msg["ok"]), bool(msg["to"]))
                w.deadline = time.monotonic() + batch.timeout  # the next task's clock starts now
        return eof

    def _retire(self, w: _Worker, batch: _Batch, timed_out: bool) -> None:
        """Kill and replace a worker; its running task is graded wrong, the ones behind it go back."""
        if w.queued:
            batch.out[w.queued.popleft()] = (False, timed_out)
            batch.todo.extendleft(reversed(w.queued))
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.mem_mb)
        self.stats["workers_started"] += 1


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
    from rlrecipe.trajectory.record import Status

    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    results = grader.grade(texts, [t.answers for t in trajs], [t.status != Status.FINISHED for t in trajs])
    for t, r in zip(trajs, results, strict=True):
        t.correct = r.correct
        t.meta["extracted"] = r.extracted
        t.meta["timed_out"] = r.timed_out
    return texts
