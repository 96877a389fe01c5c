"""What the training loops and the train engines share: the sample record, the loss-function
type and the engine interface (as `rollout/base.py` does for rollout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

# loss_fn(logp, fields) -> (loss already scaled to its share of the global batch, stats sums);
# fields["entropy"] (per-token entropy, with gradient) is there when train_step is asked with_entropy.
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class TrainSample:
    """A prompt + response sequence; per-token fields cover the response tokens (input_ids[start:]).

    input_ids: a list, or a 1-D integer tensor (RL's batch arrays: no per-token Python objects)."""

    input_ids: list[int] | torch.Tensor
    start: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_response(self) -> int:
        return len(self.input_ids) - self.start


class TrainEngine(Protocol):
    """The interface both the plain-torch and the DeepSpeed engine implement."""

    steps_done: int

    def compute_logprobs(self, samples: list[TrainSample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logp, entropy) per sample for its response tokens, under the current weights."""

    def train_step(self, samples: list[TrainSample], loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over all samples."""

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The full state dict for a rollout engine (collective under sharding)."""

    def export_hf(self, out_dir: str | Path, tokenizer=None) -> Path:
        """An HF model directory of the current weights."""

    def save(self, ckpt_dir: str | Path) -> None: ...

    def load(self, ckpt_dir: str | Path) -> None: ...
