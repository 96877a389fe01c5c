"""Plain-torch training engine: packed micro-batches, global-token-normalised accumulation,
AdamW, LR schedule, clipping, checkpoint save/load (model + optimizer + scheduler + RNG)."""

from __future__ import annotations

import contextlib
import math
import pickle
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.algo.packing import allocate_microbatches, pack, response_rows
from rlrecipe.core.errors import UserError
from rlrecipe.modeling import distinct_tensors, enable_checkpointing, load_model, load_weights_into
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train import lora
from rlrecipe.train.base import LossFn, StepResult, TrainSample, add_sums
from rlrecipe.train.logprobs import response_logprobs
from rlrecipe.train.loss_scale import DynamicLossScaler
from rlrecipe.train.varlen_attention import training_attention

# torch warns when the scheduler steps after an optimizer step that did not run; a NaN/inf step is
# skipped on purpose and still advances the schedule. Filtered once here: a catch_warnings block at
# every step would reset Python's once-only registry and repeat every other warning each step.
warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))


def capture_rng() -> dict:
    """RNG states in types `torch.load(weights_only=True)` accepts: tuples of ints, tensors, floats."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": (version, tuple(words), gauss),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
            "torch": torch.get_rng_state()}


def restore_rng(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


def load_state(path: Path) -> dict:
    """A trainer state file; `weights_only` so a tampered checkpoint cannot run code while loading."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path}: holds objects other than tensors and plain values; refusing to load it") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise UserError(f"{path}: damaged ({str(err).splitlines()[0]})") from None


def empty_device_cache() -> None:
    """Return the caching allocator's free blocks to the device, so another process can use them."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_scheduler(optimizer, cfg: TrainerSection, total_steps: int):
    warmup = cfg.warmup_steps or int(math.ceil(cfg.warmup_ratio * total_steps))
    if cfg.lr_schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, max(total_steps, 1),
                                                       min_lr_rate=cfg.min_lr_ratio)


class TorchTrainEngine:
    def __init__(self, model_dir: str | Path, cfg: TrainerSection, total_steps: int, dtype: str = "float32",
                 temperature: float = 1.0, gradient_checkpointing: bool = False, attn_implementation: str = "sdpa"):
        if dtype == "float16":
            # AdamW's second moment (g^2 ~ 1e-8) flushes to zero in float16 and the first step
            # blows the weights up; DeepSpeed keeps float32 master weights, this engine does not.
            raise UserError("model.dtype: float16 with trainer.engine: torch: this engine keeps no float32 master "
                            "weights; set model.dtype: float32 with trainer.fp16_autocast: true (float16 compute "
                            "with loss scaling), or trainer.engine: deepspeed")
        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # packed micro-batches attend per document (sdpa would mask a full T x T, on any device)
        self.model = load_model(model_dir, dtype, training_attention(attn_implementation)).to(self.device)
        if gradient_checkpointing:
            enable_checkpointing(self.model)
        if cfg.lora.enabled:  # the base frozen: only the adapter reaches the optimizer
            self.model = lora.wrap(self.model, cfg.lora)
        self.temperature = temperature
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, cfg, total_steps)
        self.steps_done = 0
        # float16 activation gradients underflow without loss scaling (train/loss_scale.py)
        self.loss_scaler = DynamicLossScaler() if cfg.fp16_autocast else None

    def trainable(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: every weight, or under trainer.lora the adapter's only."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- forward -----------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.bf16_autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.cfg.fp16_autocast:
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def _forward(self, samples: list[TrainSample], with_entropy: bool):
        """Per-response-token log-probs (and entropies) of a packed micro-batch, concatenated.

        Never materialises the micro-batch's full logits (see `train/logprobs.py`)."""
        ids, pos = pack([s.input_ids for s in samples])
        rows = response_rows(samples)
        with self._autocast():
            # the token at position t is predicted by the hidden state at t - 1
            return response_logprobs(self.model, ids.to(self.device), pos.to(self.device), rows.to(self.device),
                                     ids[0, rows + 1].to(self.device), self.temperature,
                                     self.cfg.logprob_chunk_tokens, with_entropy)

    def microbatches(self, samples: list[TrainSample]) -> list[list[TrainSample]]:
        bins = allocate_microbatches([len(s.input_ids) for s in samples], self.cfg.max_tokens_per_microbatch)
        return [[samples[i] for i in b] for b in bins]

    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainSample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logp, entropy) per sample for its response tokens, under the current weights."""
        self.model.eval()
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        index = {id(s): i for i, s in enumerate(samples)}
        for mb in self.microbatches(samples):
            logp, ent = self._forward(mb, with_entropy=True)
            for s, lp, en in zip(mb, logp.split([s.num_response for s in mb]),
                                 ent.split([s.num_response for s in mb]), strict=True):
                out[index[id(s)]] = (lp.cpu(), en.cpu())
        return [out[i] for i in range(len(samples))]

    # -- update ------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample], loss_fn: LossFn, with_entropy: bool = False) -> StepResult:
        """One optimizer step over all samples, accumulated over packed micro-batches.

        with_entropy: the loss function also gets each token's entropy, with gradient, as
        columns.entropy. Under trainer.fp16_autocast the loss is scaled for backward and the
        gradients unscaled before clipping; "overflow" marks a step skipped because the scaled gradients overflowed
        while the scaler could still lower its scale (the expected cost of loss scaling, unlike a
        NaN loss)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        total_loss = 0.0
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        for mb in self.microbatches(samples):
            logp, entropy = self._forward(mb, with_entropy=with_entropy)
            cols = TokenColumns.cat([s.columns for s in mb], self.device)
            if with_entropy:
                cols.entropy = entropy
            loss, mb_stats = loss_fn(logp, cols)
            (loss * scale if self.loss_scaler else loss).backward()
            total_loss += float(loss.detach())
            add_sums(stats, mb_stats)
        if self.loss_scaler:
            for p in self.trainable():
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable(), self.cfg.grad_clip))
        finite = math.isfinite(total_loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # a skipped step still advances the schedule, on purpose (see the filter above)
        self.steps_done += 1
        out = StepResult(total_loss, grad_norm, self.scheduler.get_last_lr()[0], skipped=not finite, sums=stats)
        if self.loss_scaler:
            out.overflow = not finite and math.isfinite(total_loss) and self.loss_scaler.can_lower()
            out.loss_scale = scale
            self.loss_scaler.update(overflow=not finite)
        return out

    # -- colocated layouts: the GPU handed to the rollout engine between updates --------------
    def offload_states(self, part: str) -> None:
        """To host memory: "optimizer" (Adam's moments; gradients are already freed) right after the
        update, "weights" once they have been pushed to the rollout engine. `reload_states` undoes both."""
        host = torch.device("cpu")
        if part == "optimizer":
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.device != host:
                        state[k] = v.to(host, non_blocking=False)
        elif part == "weights":
            if self.is_lora:  # the frozen base stays on the device in both phases (the server keeps its own too)
                return
            self.model.to(host)
        else:
            raise ValueError(f"unknown part {part!r}: 'optimizer' or 'weights'")
        empty_device_cache()

    def reload_states(self) -> None:
        """The weights and the optimizer's state back on the training device."""
        self.model.to(self.device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":  # AdamW keeps its step count on the host
                    state[k] = v.to(self.device)

    # -- state -------------------------------------------------------------------------------
    @property
    def is_lora(self) -> bool:
        return self.cfg.lora.enabled

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The weights a rollout engine serves: under trainer.lora, the base with the adapter merged."""
        if self.is_lora:
            return lora.merged_state(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(distinct_tensors(self.rollout_state()))

    def adapter_off(self):
        """A context computing with the base alone (trainer.lora): the KL reference."""
        return lora.base_without_adapter(self.model)

    def adapter_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Under trainer.lora: the adapter's PEFT config and tensors (what a LoRA push sends)."""
        return lora.adapter_config(self.model), lora.adapter_tensors(self.model)

    def export_adapter(self, out_dir: str | Path) -> Path:
        """Under trainer.lora: the adapter as a PEFT directory."""
        return lora.save_adapter(self.model, out_dir)

    def export_hf(self, out_dir: str | Path, tokenizer=None) -> Path:
        """An HF model directory; under trainer.lora the merged weights, and the adapter in
        `adapter/` inside it."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.is_lora:
            lora.save_merged(self.model.get_base_model(), out_dir, lora.merged_state(self.model))
            self.export_adapter(out_dir / lora.ADAPTER_DIR)
        else:
            self.model.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        return out_dir

    def save(self, ckpt_dir: str | Path) -> None:
        """The weights (under trainer.lora the adapter alone: the base never changes), the optimizer,
        the schedule, the step count and the RNGs."""
        ckpt_dir = Path(ckpt_dir)
        if self.is_lora:
            self.export_adapter(ckpt_dir / lora.ADAPTER_DIR)
        else:
            self.export_hf(ckpt_dir / "model")
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "steps_done": self.steps_done, "rng": capture_rng()}
        if self.loss_scaler:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        torch.save(state, ckpt_dir / "trainer_state.pt")

    def load(self, ckpt_dir: str | Path) -> None:
        ckpt_dir = Path(ckpt_dir)
        if self.is_lora:
            lora.load_adapter_into(self.model, ckpt_dir / lora.ADAPTER_DIR)
        else:
            load_weights_into(self.model, ckpt_dir / "model")
        state = load_state(ckpt_dir / "trainer_state.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state["steps_done"]
        if self.loss_scaler and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        restore_rng(state["rng"])
