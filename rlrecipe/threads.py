"""How the CPU kernels' threads wait for work, chosen before torch loads its OpenMP runtime.

torch's CPU build runs its intra-op threads on GNU OpenMP, whose threads spin while they wait for
the next parallel region. On a machine with other work running, a spinning thread burns the core
its partner needs, and every parallel region then waits for a descheduled thread: training steps
stall many times over instead of slowing in proportion to the CPU left. Threads that sleep while
they wait slow down only by the share of CPU that other processes take (docs/performance.md has
the measurements). The runtime reads the policy once, when torch is first imported, so it is set
here, in the package's first import, and only where the user has not chosen one.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DEFAULT_WAIT_POLICY = "PASSIVE"


def default_wait_policy() -> None:
    """Let OpenMP threads sleep while waiting, unless the environment already says otherwise."""
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_ENV, DEFAULT_WAIT_POLICY)


def thread_record() -> dict:
    """Threads and wait policy of this process, as env.json records them. `wait_policy` is None when
    torch was imported before this package, so the OpenMP runtime kept its own default (spinning)."""
    import torch

    policy = os.environ.get(WAIT_POLICY_ENV)
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "wait_policy": policy.upper() if policy else None}


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
