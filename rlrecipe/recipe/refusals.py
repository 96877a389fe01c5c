"""Refusals that read across a recipe's sections: why a layout or a stage cannot take what it asks.

Each answers "why not" as text, None where it can: `Recipe`'s validators (schema.py) raise it when a
recipe loads, and the checks before a run (checks/colocate.py, checks/preflight.py) ask the same
question of the layout or stage they are about to build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlrecipe.recipe.schema import Recipe

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
ELSEWHERE = ("a handle opens only on the machine that shares it; use weight_sync: tensor or disk, or "
             "rollout.colocate")


def ipc_refusal(*, colocated: bool, trainer_nodes: int = 1, rollout_nodes: int = 1, server_gpus: int = 0,
                trainer_ranks: int = 0) -> str | None:
    """Why `rollout.sglang.weight_sync: ipc` cannot serve a layout ("N nodes: why"), None where it can:
    each server rank reads the handles of one trainer rank of its own, once, on its machine. Colocated
    that is the rank on its GPU, on any number of nodes; split, only on one node with no more server
    GPUs (launched: num_servers x tp_size) than trainer ranks."""
    if colocated:
        return None
    if trainer_nodes > 1 or rollout_nodes > 1:
        return f"{max(trainer_nodes, rollout_nodes)} nodes: {ELSEWHERE}"
    if server_gpus > trainer_ranks:
        return (f"{server_gpus} server GPUs (num_servers x tp_size) and {trainer_ranks} trainer ranks: each server "
                "rank reads the handles of one trainer rank, once; use weight_sync: tensor or disk")
    return None


LORA_ARGS = "{lora_args}"  # the launch_cmd argument that stands for SGLang's LoRA flags


def rl_lora_refusal(recipe: Recipe) -> str | None:
    """Why an RL run cannot take the recipe's trainer.lora ("field: why"), None where it can."""
    lora, ro = recipe.trainer.lora, recipe.rollout
    if not lora.enabled:
        return None
    if lora.dropout > 0:
        # the ratio's old log-probs, the KL reference and the rollouts are taken without dropout:
        # with it the policy trained is another one, and on-policy the ratio is no longer 1
        return (f"trainer.lora.dropout: {lora.dropout} with RL: the old policy's, the reference's and the rollouts' "
                "log-probs have no dropout, so the PPO ratio would be off even on-policy; set 0 (SFT may keep it)")
    if ro.engine == "sglang" and ro.sglang.launch_cmd and LORA_ARGS not in ro.sglang.launch_cmd:
        # a server started without --enable-lora refuses the first adapter pushed to it
        return (f"rollout.sglang.launch_cmd: no \"{LORA_ARGS}\" argument, so the servers it starts take no adapter "
                f"(--enable-lora) under trainer.lora; add the argument \"{LORA_ARGS}\" (nothing without LoRA)")
    return None
