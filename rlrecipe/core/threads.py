"""How the CPU kernels' threads wait for work, chosen before torch loads its OpenMP runtime.

torch's CPU build runs its intra-op threads on GNU OpenMP, whose idle threads spin (by default
300,000 rounds) waiting for the next parallel region. On a machine with other work running, a
spinning thread burns the core its partner needs, and every parallel region then waits for a
descheduled thread: training steps stall many times over instead of slowing by the CPU share that
is taken. Threads that sleep at once stop the stall but pay a wake-up at every region on a quiet
machine. A short spin (GOMP_SPINCOUNT, 1,000 rounds: microseconds) keeps the quiet speed, because
back-to-back regions still find their threads awake, and gives the core up soon under load
(docs/performance.md has the measurements: `python -m bench.thread_load`). The runtime reads these
once, when torch is first imported, so they are set here, in the package's first import, and only
where the user has set neither.
"""

from __future__ import annotations

import os
import sys

SPIN_ENV, POLICY_ENV = "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"
DEFAULT_SPINCOUNT = "1000"


def default_wait_policy() -> None:
    """A short spin before OpenMP threads sleep, unless the environment already chose how they wait."""
    if "torch" not in sys.modules and SPIN_ENV not in os.environ and POLICY_ENV not in os.environ:
        os.environ[SPIN_ENV] = DEFAULT_SPINCOUNT


def thread_record() -> dict:
    """Threads and wait settings of this process, as env.json records them. `wait_policy` is None when
    the OpenMP runtime kept its own default (long spins): nothing set, or torch imported first."""
    import torch

    policy = os.environ.get(POLICY_ENV)
    spin = os.environ.get(SPIN_ENV)
    described = ", ".join(x for x in (f"{POLICY_ENV}={policy.upper()}" if policy else "",
                                      f"{SPIN_ENV}={spin}" if spin else "") if x)
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "wait_policy": described or None}


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
