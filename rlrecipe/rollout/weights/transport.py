"""How the trainer's weights reach the rollout engine after each step: decided here, once.

Gathering a sharded trainer's weights is collective, so every training rank must know the
transport, while only rank 0 holds the engine: the decision is made from the recipe alone, and
the RL loop and the SGLang engine both ask this function.
"""

from __future__ import annotations

from enum import Enum

from rlrecipe.recipe.systems import SGLangServer


class WeightTransport(Enum):
    IN_MEMORY = "in_memory"  # the in-process engine takes the trainer's state dict
    BROADCAST = "broadcast"  # SGLang, weight_sync distributed: tensors broadcast into the servers
    DISK = "disk"  # SGLang, weight_sync disk: an HF export that the servers load
    TENSOR = "tensor"  # SGLang, weight_sync tensor: tensors pickled into /update_weights_from_tensor
    IPC = "ipc"  # SGLang, weight_sync ipc: every rank's tensors shared by handle, same request


def weight_transport(engine: str, sglang: SGLangServer) -> WeightTransport:
    """The transport for `rollout.engine` = `engine` under `rollout.sglang` = `sglang`."""
    if engine == "inprocess":
        return WeightTransport.IN_MEMORY
    return {"distributed": WeightTransport.BROADCAST, "tensor": WeightTransport.TENSOR,
            "ipc": WeightTransport.IPC}.get(sglang.weight_sync, WeightTransport.DISK)
