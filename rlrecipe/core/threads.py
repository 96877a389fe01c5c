"""How the CPU kernels' threads wait for work, chosen before torch loads its OpenMP runtime.

torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle threads spin (300,000
rounds by default) waiting for the next parallel region. When other tasks want the cores, a
spinning thread burns the core its partner needs and every parallel region waits for a
descheduled thread: steps stall several times over. So the package looks once, at its first
import, at how many other tasks are runnable (/proc/stat): if they want more cores than our threads
leave free, idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE); otherwise the runtime keeps its
long default spin, the fastest wait for kernels that run alone. A process that runs HTTP threads
beside its kernels is its own competing load: under the long spin a server's streamed chunks and
aborts, and an SGLang client's aborts, arrived late. So importing the server package first, or an
RL stage whose rollout engine is SGLang, turns a quiet choice into a short spin
(GOMP_SPINCOUNT=1000). The runtime reads the setting once, when torch is first imported, so a load
that starts later is not seen; a setting the user made is kept. The wait changes speed only, never
results. Measurements: docs/performance.md ("Threads on a busy machine"), `python -m bench.thread_load`.
"""

from __future__ import annotations

import os
import sys
import time

SPIN_ENV, POLICY_ENV, THREADS_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS"
PASSIVE = "PASSIVE"
SHORT_SPIN = "1000"  # rounds: microseconds
# How the package chose, in words, for env.json (None: it was not its choice to make)
WAIT_CHOICE: str | None = None


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _planned_threads(cores: int) -> int:
    """The intra-op threads torch will start: OMP_NUM_THREADS's first level, else one per core."""
    try:
        return max(1, int(os.environ.get(THREADS_ENV, "").split(",")[0]))
    except ValueError:
        return cores


def others_running(samples: int = 3, gap_s: float = 0.001) -> int | None:
    """Runnable tasks besides this process (the fewest of a few readings of /proc/stat's
    procs_running, which counts this process too), or None where that cannot be read."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        try:
            with open("/proc/stat", "rb") as f:
                counts += [int(line.split()[1]) for line in f if line.startswith(b"procs_running ")]
        except (OSError, ValueError, IndexError):
            return None
    return min(counts) - 1 if counts else None


def choose_wait(others: int | None, threads: int, cores: int) -> str | None:
    """OMP_WAIT_POLICY for a process about to start `threads` intra-op threads on `cores` while
    `others` other tasks are runnable: PASSIVE (idle threads sleep at once) when those tasks want
    more than the cores our threads leave free, or when the load cannot be read; None (quiet: the
    runtime's default spin) otherwise. More threads than cores alone is not load."""
    if others is None or others > max(0, cores - threads):
        return PASSIVE
    return None


def _wait_settled() -> bool:
    """Too late, or not ours, to choose: torch (and its OpenMP runtime) is loaded, or a wait is set."""
    return "torch" in sys.modules or SPIN_ENV in os.environ or POLICY_ENV in os.environ


def default_wait_policy() -> None:
    """Choose how OpenMP threads wait, unless the environment already did or torch is loaded."""
    global WAIT_CHOICE
    if _wait_settled():
        return
    cores = _usable_cores()
    threads, others = _planned_threads(cores), others_running()
    policy = choose_wait(others, threads, cores)
    load = "load unknown" if others is None else f"{others} other runnable task(s)"
    WAIT_CHOICE = (f"{'busy' if policy else 'quiet'} at start ({load}, {threads} thread(s) on {cores} core(s)): "
                   + (f"{POLICY_ENV}={policy}" if policy else "the runtime's default spin"))
    if policy:
        os.environ[POLICY_ENV] = policy


def threaded_wait_policy(why: str = "serving HTTP beside the kernels") -> None:
    """In a process about to run HTTP threads beside its kernels (a server; an RL stage's SGLang
    client, whose aborts must land while the trainer computes): a quiet choice becomes the short
    spin. Nothing changes where the user set the wait, the machine was busy, or torch is loaded."""
    global WAIT_CHOICE
    if WAIT_CHOICE is None or _wait_settled():
        return
    os.environ[SPIN_ENV] = SHORT_SPIN
    WAIT_CHOICE += f"; {why}: {SPIN_ENV}={SHORT_SPIN}"


def thread_record() -> dict:
    """Threads and wait settings of this process, as env.json records them. `wait_policy` is None when
    the OpenMP runtime kept its own default (long spins): nothing set, or torch imported first."""
    import torch

    policy = os.environ.get(POLICY_ENV)
    spin = os.environ.get(SPIN_ENV)
    described = ", ".join(x for x in (f"{POLICY_ENV}={policy.upper()}" if policy else "",
                                      f"{SPIN_ENV}={spin}" if spin else "") if x)
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "wait_policy": described or None, "wait_choice": WAIT_CHOICE}


def thread_change(recorded: dict | None, now: dict) -> str | None:
    """What differs between a run's recorded threads and this process's, in words, or None. Float
    reductions split across another number of threads round differently, so a resumed run is
    bit-identical to an uninterrupted one only with the same thread count."""
    if not recorded:
        return None
    before, after = recorded.get("torch_threads"), now.get("torch_threads")
    if before is None or before == after:
        return None
    return (f"this run started with {before} intra-op thread(s) and resumes with {after}: the results "
            f"stay valid but are not bit-identical to an uninterrupted run (set OMP_NUM_THREADS={before} "
            "to match)")
