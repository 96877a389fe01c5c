"""Derived seeds: the one place a run's seed is mixed with a counter into the seed of a stream.

Every random stream the run draws (a step's rollout sampling, an epoch's shuffle, a C3PO++
generate round) gets `seed * stride + index`, with a stride per stream. The strides are primes
larger than any index a stream reaches in practice, so two seeds of one stream never collide; the
golden run pins the streams they produce, so none of them may change.
"""

from __future__ import annotations

ROLLOUT_STEP = 100003  # a step's rollout sampling seed (rollout_schedule.step_seed)
SFT_EPOCH = 100003  # an SFT epoch's shuffle of the training samples
PROMPT_EPOCH = 7919  # an RL prompt stream's epoch shuffle (c3po.PromptStream)
GENERATE_ROUND = 1009  # a C3PO++ step's generate call, per round until the budget is met
DYNAMIC_ROUND = 1013  # a synchronous step's extra round of groups under dynamic sampling


def mix_seed(seed: int, index: int, stride: int) -> int:
    """The seed of draw `index` (a step, an epoch, a round) of the stream whose stride is `stride`."""
    return seed * stride + index
