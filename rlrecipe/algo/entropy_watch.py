"""Entropy alarms: the mean token entropy of each step's batch, watched for collapse and explosion.

Entropy collapse: the policy turns near-deterministic, stops exploring and its reward saturates
(Cui et al. 2025, arXiv:2505.22617). Entropy explosion: the output turns to noise, as in the
collapses under train/inference mismatch that IcePop targets (Ring-1T). One step out of bounds is
noise; `patience` steps in a row is an alarm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def _console_warning(message: str) -> None:
    from rlrecipe.core.console import console

    console.print(f"[bold yellow]warning:[/] {message}")


class EntropyWatch:
    """Fed each step's mean token entropy; flags an alarm while it has stayed under `low` (collapse)
    or over `high` (explosion) for `patience` consecutive steps, warning once as each alarm starts."""

    def __init__(self, low: float | None, high: float | None, patience: int,
                 warn: Callable[[str], None] = _console_warning):
        self.low, self.high, self.patience, self.warn = low, high, patience, warn
        self.steps_below = 0
        self.steps_above = 0

    @property
    def enabled(self) -> bool:
        return self.low is not None or self.high is not None

    def update(self, entropy: float, step: int | None = None) -> dict[str, float]:
        """The alarm flags for this step ({} when no bound is set)."""
        if not self.enabled:
            return {}
        self.steps_below = self.steps_below + 1 if self.low is not None and entropy < self.low else 0
        self.steps_above = self.steps_above + 1 if self.high is not None and entropy > self.high else 0
        where = f"step {step}: " if step is not None else ""
        if self.steps_below == self.patience:
            self.warn(f"{where}entropy collapse: mean token entropy {entropy:.4g} below {self.low} "
                      f"for {self.patience} steps")
        if self.steps_above == self.patience:
            self.warn(f"{where}entropy explosion: mean token entropy {entropy:.4g} above {self.high} "
                      f"for {self.patience} steps")
        return {"entropy_collapse_alarm": float(self.steps_below >= self.patience),
                "entropy_explosion_alarm": float(self.steps_above >= self.patience)}

    def resume(self, entropies: Iterable[float]) -> None:
        """The counters as they stood after the steps of `entropies` (a resumed run's logged ones, in
        order), without warning again: a streak that began before a kill goes on counting."""
        entropies = list(entropies)
        self.steps_below = trailing_run(entropies, lambda e: self.low is not None and e < self.low)
        self.steps_above = trailing_run(entropies, lambda e: self.high is not None and e > self.high)

    @classmethod
    def from_config(cls, cfg, quiet: bool = False) -> EntropyWatch:
        """From the recipe's `rl.entropy_watch` section; quiet: flags only, no warning (ranks but 0)."""
        return cls(cfg.low, cfg.high, cfg.patience, (lambda _message: None) if quiet else _console_warning)


def trailing_run(values: list, holds: Callable[[object], bool]) -> int:
    """How many of the last values in a row satisfy `holds`."""
    n = 0
    for v in reversed(values):
        if not holds(v):
            break
        n += 1
    return n
