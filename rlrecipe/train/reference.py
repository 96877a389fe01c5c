"""The reference policy for the KL penalty: a frozen copy of the initial policy (under trainer.lora,
the trainer's base with its adapter off).

Built only when `rl.kl_coef > 0` (AReaL-boba uses none). It packs samples into micro-batches and
computes log-probs with the same chunked code as the train engines (`train/logprobs.py`), so
logp_ref and logp_old differ only by the weights. Under DeepSpeed every rank holds a whole copy and
computes the whole batch: fine for the models this is meant for, not partitioned like ZeRO-3.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rlrecipe.algo.packing import allocate_microbatches, pack, response_rows
from rlrecipe.modeling import load_model
from rlrecipe.train.base import TrainSample
from rlrecipe.train.logprobs import response_logprobs
from rlrecipe.train.varlen_attention import training_attention


class ReferencePolicy:
    def __init__(self, model_dir: str | Path, dtype: str = "float32", temperature: float = 1.0,
                 max_tokens_per_microbatch: int = 30720, chunk_tokens: int = 1024, attn_implementation: str = "sdpa",
                 autocast_dtype: torch.dtype | None = None):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        attention = training_attention(attn_implementation)  # packed rows, per document
        self.model = load_model(model_dir, dtype, attention).to(self.device).eval()
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.max_tokens = max_tokens_per_microbatch
        self.chunk_tokens = chunk_tokens
        self.autocast_dtype = autocast_dtype  # the trainer's autocast, so logp_ref is computed as logp is

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """log pi_ref of each sample's response tokens (on the CPU, in sample order)."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        for mb in allocate_microbatches([len(s.input_ids) for s in samples], self.max_tokens):
            ids, pos = pack([samples[i].input_ids for i in mb])
            rows = response_rows([samples[i] for i in mb])
            with self._autocast():  # the token at position t is predicted by the hidden state at t - 1
                logp, _ = response_logprobs(self.model, ids.to(self.device), pos.to(self.device), rows.to(self.device),
                                            ids[0, rows + 1].to(self.device), self.temperature, self.chunk_tokens)
            for i, lp in zip(mb, logp.split([samples[i].num_response for i in mb]), strict=True):
                out[i] = lp.cpu()
        return out  # type: ignore[return-value]


class AdapterOffReference:
    """Under trainer.lora the initial policy is the trainer's own base: its log-probs with the adapter
    switched off, so no second model is held."""

    def __init__(self, trainer):
        self.trainer = trainer

    def logprobs(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        with self.trainer.adapter_off():
            return [logp for logp, _ in self.trainer.compute_logprobs(samples)]


def make_reference(recipe, model_dir: str | Path, trainer=None) -> ReferencePolicy | AdapterOffReference | None:
    """The recipe's reference policy from the initial weights in `model_dir` (under trainer.lora,
    `trainer` with its adapter off), or None when `rl.kl_coef` is 0 (then nothing is loaded)."""
    if recipe.rl.kl_coef == 0:
        return None
    if recipe.trainer.lora.enabled:
        return AdapterOffReference(trainer)
    tr = recipe.trainer
    autocast = torch.bfloat16 if tr.bf16_autocast else torch.float16 if tr.fp16_autocast else None
    return ReferencePolicy(model_dir, recipe.model.dtype, recipe.rollout.temperature, tr.max_tokens_per_microbatch,
                           tr.logprob_chunk_tokens, recipe.model.attn_implementation, autocast)
