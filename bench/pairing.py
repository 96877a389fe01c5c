"""Paired rounds: arms taken in turn within each round, a ratio per round, its median and range.

This machine drifts between speeds for minutes at a time, and other work comes and goes: timing one
arm's runs after the other's compares the drift. Within a round the arms run one after the other,
seconds or a minute apart, so each round's ratio compares like with like; the median of the rounds'
ratios is the figure, and their min and max say how far to trust it (a range of 1.12 to 4.07 says
nothing). bench/run.py's in-process comparisons, bench/colocated_phases.py and bench/async_overlap.py
report their ratios so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median


def paired_rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Wall times of each of `fns`, taken in turn within each round (after one warm-up call each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """Each round's `num` over its `den` (the same round's two arms)."""
    return [a / b for a, b in zip(num, den, strict=True)]


def round_ratios(times: dict[str, list[float]], num: str, den: str) -> list[float]:
    """Each round's `num` time over its `den` time (paired_rounds: the two taken seconds apart)."""
    return paired_ratios(times[num], times[den])


def ratio_summary(key: str, ratios: list[float]) -> dict:
    """`key`: the median of the rounds' ratios; `key`_min, `key`_max: their range; `key`_rounds: how many."""
    return {key: median(ratios), f"{key}_min": min(ratios), f"{key}_max": max(ratios), f"{key}_rounds": len(ratios)}


def paired(runs: dict[str, list[dict]], key: str, num: str, den: str, field: str) -> dict:
    """`ratio_summary` of `field` of arm `num` over arm `den`, round by round (runs[arm][i] is round i's)."""
    return ratio_summary(key, paired_ratios([r[field] for r in runs[num]], [r[field] for r in runs[den]]))
