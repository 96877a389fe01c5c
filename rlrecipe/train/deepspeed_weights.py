"""A DeepSpeed engine's model read whole: the rollout's weights, the HF export's, the LoRA adapter.

Under ZeRO-1/2 every rank holds the whole model, so its own tensors are read (views, as the torch
engine returns them). Under ZeRO-3 each rank holds a partition: the parameters are gathered module by
module (a collective every rank runs in step) and the gathered copies are freed after each module,
so no rank ever holds the whole model on the device. Under trainer.lora the weights are the base
model's, under its names, with the adapter merged into each wrapped layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlrecipe.modeling import distinct_tensors
from rlrecipe.train import lora


class DeepSpeedWeights:
    def __init__(self, engine, zero3: bool, is_lora: bool, rank: int):
        self.engine, self.zero3, self.is_lora, self.rank = engine, zero3, is_lora, rank

    def hf_module(self) -> torch.nn.Module:
        """The model under its HF names (under trainer.lora, inside PEFT's wrapper)."""
        return self.engine.module.get_base_model() if self.is_lora else self.engine.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0, {} on other ranks. Collective.

        ZeRO-3: gathered module by module onto rank 0 and copied to CPU. ZeRO-1/2: the module's own
        tensors (views, as TorchTrainEngine.rollout_state returns)."""
        module = self.engine.module
        if not self.zero3:  # every rank holds the whole model: views, no copy (as the torch engine)
            if self.rank != 0:
                return {}
            return lora.merged_state(module) if self.is_lora else {k: v.detach() for k, v in module.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for key, t, tied_to in self._gathered():
            if self.rank == 0:  # tied weights stay tied
                out[key] = out[tied_to] if tied_to is not None else t.to("cpu", copy=True)
        return out

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank: the full weights, tied ones once. ZeRO-3 gathers module by module and yields
        copies on the device (the gathered tensors are freed when the module's turn ends)."""
        if not self.zero3:
            module = self.engine.module
            yield from distinct_tensors(lora.merged_state(module) if self.is_lora else
                                        {k: v.detach() for k, v in module.state_dict().items()})
            return
        yield from ((key, t.clone()) for key, t, tied_to in self._gathered() if tied_to is None)

    def adapter_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Under trainer.lora, every rank: the adapter's config and tensors (on the CPU). Collective
        under ZeRO-3 (the adapter is gathered: megabytes)."""
        import deepspeed

        module = self.engine.module
        trainable = [p for p in module.parameters() if p.requires_grad]
        gather = deepspeed.zero.GatheredParameters(trainable, modifier_rank=None) if self.zero3 \
            else contextlib.nullcontext()
        with gather:
            tensors = {k: v.to("cpu", copy=True) for k, v in lora.adapter_tensors(module).items()}
        return lora.adapter_config(module), tensors

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor, str | None]]:
        """ZeRO-3, every rank: each parameter and persistent buffer as (name, tensor, the name of the
        parameter it is tied to or None), gathered module by module. Collective: consume in step; a
        tensor is valid until the next item (the module's gathered copies are freed after it). Under
        trainer.lora: the base model's names, each wrapped layer's weight with the adapter merged."""
        import deepspeed

        first: dict[int, str] = {}

        def visit(mod: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, str | None]]:
            if lora.is_lora_layer(mod):  # base and adapter gathered together: the merge needs both
                with deepspeed.zero.GatheredParameters(list(mod.parameters()), modifier_rank=None):
                    yield from ((prefix + name, t, None) for name, t in lora.merged_layer(mod))
                return
            with deepspeed.zero.GatheredParameters(list(mod.parameters(recurse=False)), modifier_rank=None):
                for name, p in mod.named_parameters(recurse=False):
                    yield prefix + name, p.detach(), first.get(p.ds_id)
                    first.setdefault(p.ds_id, prefix + name)
                for name, buf in mod.named_buffers(recurse=False):
                    if name not in mod._non_persistent_buffers_set:
                        yield prefix + name, buf.detach(), None
            for name, child in mod.named_children():
                yield from visit(child, prefix + name + ".")

        yield from visit(self.hf_module(), "")
