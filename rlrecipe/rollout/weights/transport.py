"""How the trainer's weights reach the rollout engine after each step: decided here, once.

Gathering a sharded trainer's weights is collective, so every training rank must know the
transport, while only rank 0 holds the engine: the decision is made from the recipe alone, and
the RL loop and the SGLang engine both ask this function.

Under trainer.lora, SGLang keeps its base weights and takes the adapter alone (a new adapter per
push, named in every /generate): `weight_sync: tensor` posts it by value to
/load_lora_adapter_from_tensors, `disk` (the default) writes a PEFT directory that
/load_lora_adapter reads. SGLang loads adapters no other way, so `distributed` and `ipc` are refused.
The in-process engine takes the merged weights either way.
"""

from __future__ import annotations

from enum import Enum

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer


class WeightTransport(Enum):
    IN_MEMORY = "in_memory"  # the in-process engine takes the trainer's state dict
    BROADCAST = "broadcast"  # SGLang, weight_sync distributed: tensors broadcast into the servers
    DISK = "disk"  # SGLang, weight_sync disk: an HF export that the servers load
    TENSOR = "tensor"  # SGLang, weight_sync tensor: tensors pickled into /update_weights_from_tensor
    IPC = "ipc"  # SGLang, weight_sync ipc: every rank's tensors shared by handle, same request
    LORA_TENSOR = "lora_tensor"  # SGLang under trainer.lora, weight_sync tensor: /load_lora_adapter_from_tensors
    LORA_DISK = "lora_disk"  # SGLang under trainer.lora, weight_sync disk: a PEFT directory, /load_lora_adapter

    @property
    def is_lora(self) -> bool:
        return self in (WeightTransport.LORA_TENSOR, WeightTransport.LORA_DISK)


def weight_transport(engine: str, sglang: SGLangServer, lora: bool = False) -> WeightTransport:
    """The transport for `rollout.engine` = `engine` under `rollout.sglang` = `sglang`; `lora`:
    trainer.lora is enabled."""
    if engine == "inprocess":
        return WeightTransport.IN_MEMORY
    plain = {"distributed": WeightTransport.BROADCAST, "tensor": WeightTransport.TENSOR,
             "ipc": WeightTransport.IPC}.get(sglang.weight_sync, WeightTransport.DISK)
    return for_lora(plain) if lora else plain


def for_lora(transport: WeightTransport) -> WeightTransport:
    """What `transport` becomes under trainer.lora (the same for the in-process engine and the LoRA
    transports); a UserError for a weight_sync that cannot carry an adapter."""
    if transport in (WeightTransport.BROADCAST, WeightTransport.IPC):
        sync = "distributed" if transport is WeightTransport.BROADCAST else "ipc"
        raise UserError(f"trainer.lora with rollout.sglang.weight_sync {sync}: SGLang takes an adapter only by "
                        "/load_lora_adapter_from_tensors or from disk; set weight_sync tensor (or disk)")
    return {WeightTransport.TENSOR: WeightTransport.LORA_TENSOR,
            WeightTransport.DISK: WeightTransport.LORA_DISK}.get(transport, transport)
