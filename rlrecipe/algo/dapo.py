"""DAPO's (Yu et al. 2025, arXiv:2503.14476) rules on groups and lengths, as pure functions.

Dynamic sampling (Sec. 3.2) keeps a prompt's group only while 0 < #correct < G: a group whose
samples are all right or all wrong has zero advantage under group normalisation. Overlong reward
shaping (Sec. 3.4) adds a length penalty over the last `cache` tokens before the length limit.
Where they act in a step (the pool, the reward, the loss weights) is rl/pool.py's and
stages/rl.py's; docs/design.md says how they meet C3PO++'s token budget.
"""

from __future__ import annotations


def group_has_signal(correct: list[bool]) -> bool:
    """DAPO's constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G on one group's verdicts."""
    right = sum(bool(c) for c in correct)
    return 0 < right < len(correct)


def overlong_penalty(length: int, max_length: int, cache: int, factor: float = 1.0) -> float:
    """Soft overlong punishment R_length(y) times `factor`: 0 up to max_length - cache tokens, then
    ((max_length - cache) - |y|) / cache, falling linearly to -1 at max_length, and -1 beyond it.

    `max_length` is the limit a response is truncated at (rollout.max_new_tokens); `cache` 0 = off."""
    if cache <= 0:
        return 0.0
    free = max_length - cache
    if length <= free:
        return 0.0
    return -factor * min(1.0, (length - free) / cache)
