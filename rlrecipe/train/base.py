"""What the training loops and the train engines share: the sample record, the loss-function
type and the engine interface (as `rollout/base.py` does for rollout)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from rlrecipe.algo.columns import Sums, TokenColumns

# loss_fn(logp, columns) -> (loss already scaled to its share of the global batch, a Sums record);
# columns.entropy (per-token entropy, with gradient) is there when train_step is asked with_entropy.
LossFn = Callable[[torch.Tensor, TokenColumns], tuple[torch.Tensor, Sums]]


@dataclass
class TrainSample:
    """A prompt + response sequence; its columns cover the response tokens (input_ids[start:]).

    input_ids: a list, or a 1-D integer tensor (RL's batch arrays: no per-token Python objects)."""

    input_ids: list[int] | torch.Tensor
    start: int
    columns: TokenColumns = field(default_factory=TokenColumns)

    @property
    def num_response(self) -> int:
        return len(self.input_ids) - self.start


def add_sums(totals: dict[str, float], stats: Sums | Mapping[str, float]) -> None:
    """Add a micro-batch's statistics (a Sums record, or a plain mapping from a hand-written loss)
    into an engine's running totals, a plain dict."""
    for k, v in (stats.as_dict() if isinstance(stats, Sums) else stats).items():
        totals[k] = totals.get(k, 0.0) + v


@dataclass
class StepResult:
    """What one optimizer step reports, on every engine."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool  # the update was not applied: a NaN/inf loss or gradient (or a float16 overflow)
    sums: dict[str, float] = field(default_factory=dict)  # the loss function's statistics, summed
    loss_scale: float | None = None  # the scale the step ran with, under float16 loss scaling only
    overflow: bool = False  # skipped on an overflow that loss scaling handles by lowering its scale

    def additive(self) -> dict[str, float]:
        """The numbers that add up over minibatches (the loss scale, a state, is left out)."""
        out = {"loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "skipped": float(self.skipped),
               **self.sums}
        if self.loss_scale is not None:
            out["overflow"] = float(self.overflow)
        return out


class TrainEngine(Protocol):
    """The interface both the plain-torch and the DeepSpeed engine implement."""

    steps_done: int

    def compute_logprobs(self, samples: list[TrainSample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logp, entropy) per sample for its response tokens, under the current weights."""

    def train_step(self, samples: list[TrainSample], loss_fn: LossFn, with_entropy: bool = False) -> StepResult:
        """One optimizer step over all samples."""

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The full state dict for a rollout engine (collective under sharding)."""

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the full weights one tensor at a time, on the trainer's device, tied ones once, in
        the same order on every rank (collective under sharding: consume in step)."""

    def export_hf(self, out_dir: str | Path, tokenizer=None) -> Path:
        """An HF model directory of the current weights."""

    def save(self, ckpt_dir: str | Path) -> None: ...

    def load(self, ckpt_dir: str | Path) -> None: ...
