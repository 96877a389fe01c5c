"""The loss's inputs and outputs as typed records: per-token columns in, summed statistics out.

A step's batch reaches the loss as `TokenColumns`, one tensor per column over a sample's response
tokens. The prepare step (rl.py `attach_ppo_fields`, sft.py) fills the columns it computes; the
engines cut samples into micro-batches and join their columns with `TokenColumns.cat`, without
knowing which columns exist; the loss reads them by name. A new remedy adds its column here, its
rule in algo/, and one line where the batch is prepared.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TokenColumns:
    """Per-response-token tensors of one sample or one micro-batch; None where not computed."""

    scale: torch.Tensor | None = None  # the token's share of the global loss (loss aggregation)
    logp_old: torch.Tensor | None = None  # proximal policy: the trainer's log-prob at the step's start
    logp_infer: torch.Tensor | None = None  # behaviour policy: the rollout engine's log-prob
    adv: torch.Tensor | None = None  # the sequence's advantage on each of its tokens
    weight: torch.Tensor | None = None  # IcePop / TIS weight of the train/inference mismatch
    seq: torch.Tensor | None = None  # index of the token's sequence in the step's batch (GSPO, V3.2 mask)
    logp_ref: torch.Tensor | None = None  # frozen reference policy (KL penalty)
    entropy: torch.Tensor | None = None  # with gradient; the engine adds it when the loss asks for it

    @classmethod
    def cat(cls, parts: list[TokenColumns], device: torch.device | str | None = None) -> TokenColumns:
        """The parts' columns end to end (a micro-batch from its samples); a column joins only if
        every part has it."""
        out = cls()
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if values and all(v is not None for v in values):
                setattr(out, f.name, torch.cat(values).to(device) if device is not None else torch.cat(values))
        return out

    def need(self, *names: str) -> tuple[torch.Tensor, ...]:
        """The named columns, or an error naming the first one the prepare step did not fill."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"the loss needs the column {missing[0]!r}, which the batch does not have")
        return tuple(getattr(self, n) for n in names)


class Sums:
    """A record of summed statistics: adds field by field, flattens to a dict for the metrics."""

    def __add__(self, other):
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class LossStats(Sums):
    """What one micro-batch's policy loss counted; each remedy's counts stay 0 while it is off."""

    microbatches: float = 0.0
    tokens: float = 0.0
    active_tokens: float = 0.0  # weight != 0 (IcePop keeps them, the V3.2 mask has not dropped them)
    clipped_tokens: float = 0.0
    dual_clipped_tokens: float = 0.0
    ratio_sum: float = 0.0  # pi_theta / pi_old over the active tokens
    offpolicy_dropped_seqs: float = 0.0  # V3.2 mask
    seqs: float = 0.0  # GSPO: sequences, their ratios' sum, how many the clip bound
    seq_ratio_sum: float = 0.0
    seq_clipped: float = 0.0
    cov_selected_tokens: float = 0.0  # Clip-Cov / KL-Cov
    kl_ref_sum: float = 0.0
    entropy_bonus: float = 0.0
