"""The values `rlrecipe fit` tries, and the recipe variants it plans them as: each variant is the source
recipe with a layout's fields replaced (unvalidated), planned by plan.py as `rlrecipe plan` would."""

from __future__ import annotations

import math

from rlrecipe.checks.fit_layout import Machine
from rlrecipe.checks.memory import SGLANG_OUTSIDE_POOL_GIB, TRAINER_OFFLOADED_GIB
from rlrecipe.checks.model_dims import ModelDims
from rlrecipe.recipe.schema import Recipe

# SGLang's activations, CUDA graphs and sampler live outside its static pool: at least
# SGLANG_OUTSIDE_POOL_GIB of a GPU stays outside it (memory.py). Colocated, the offloaded trainer
# stays too, so smaller fractions are tried there (a small card has little room beside the pool).
MEM_FRACTIONS = (0.9, 0.85, 0.8, 0.75, 0.7)
COLOCATED_FRACTIONS = MEM_FRACTIONS + (0.65, 0.6, 0.55, 0.5)
TP_SIZES = (1, 2, 4, 8)
ZERO = ((3, False, False), (2, False, False), (1, False, False), (3, True, False), (2, True, False),
        (1, True, False), (3, True, True))
# Colocated: ZeRO-3 only, whose ranks hold the least while offloaded and reload the least (the trainer
# hands ZeRO-3's optimizer state over with DeepSpeed's FusedAdam on CUDA)
COLOCATED_ZERO = tuple(z for z in ZERO if z[0] == 3)
# Colocated under LoRA the frozen base stays on the GPU in both phases, so not its parameters offloaded
# (DeepSpeed's offload_states, the hand-over, also refuses offloaded parameters)
COLOCATED_LORA_ZERO = tuple(z for z in COLOCATED_ZERO if not z[2])
CHUNK_DIVISORS = (1, 2, 4)


def with_fields(recipe: Recipe, **sections: dict) -> Recipe:
    """The recipe with some fields of some sections replaced, unvalidated (the search's variants)."""
    update = {name: getattr(recipe, name).model_copy(update=fields) for name, fields in sections.items()}
    return recipe.model_copy(update=update)


def microbatch_candidates(recipe: Recipe) -> list[int]:
    """The source's micro-batch, and the smallest that holds one full-length sequence."""
    seq = recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens
    least = 1024 * math.ceil(seq / 1024)
    return sorted({recipe.trainer.max_tokens_per_microbatch, least}, reverse=True)


def chunk_candidates(recipe: Recipe) -> list[int]:
    c = recipe.trainer.logprob_chunk_tokens
    return sorted({max(128, c // k) for k in CHUNK_DIVISORS}, reverse=True)


def tp_candidates(d: ModelDims, machine: Machine, gpus: int) -> list[int]:
    """Tensor-parallel sizes within a node that divide the GPUs, the heads and the KV heads."""
    return [tp for tp in TP_SIZES if tp <= machine.gpus and gpus % tp == 0
            and d.heads % tp == 0 and d.kv_heads % tp == 0]


def outside_pool_gib(colocated: bool = False, trainer_kept_gib: float = 0.0) -> float:
    """GiB of a GPU a server's static pool must leave free: SGLang's outside-the-pool allowance and,
    colocated, the offloaded trainer's, with what it keeps on the GPU under LoRA (`trainer_kept_gib`)."""
    return SGLANG_OUTSIDE_POOL_GIB + (TRAINER_OFFLOADED_GIB + trainer_kept_gib if colocated else 0.0)


def fractions(machine: Machine, colocated: bool = False, trainer_kept_gib: float = 0.0) -> list[float]:
    """Memory fractions that leave `outside_pool_gib` free."""
    room = outside_pool_gib(colocated, trainer_kept_gib) / machine.gpu_memory_gib
    return [f for f in (COLOCATED_FRACTIONS if colocated else MEM_FRACTIONS) if 1 - f >= room - 1e-9]


def train_variant(recipe: Recipe, machine: Machine, ranks: int, nodes: int, stage: int, opt: bool, par: bool,
                  micro: int, chunk: int, colocated: bool = False, push: str | None = None,
                  tp: int | None = None) -> Recipe:
    """The recipe trained on `ranks` GPUs over `nodes` nodes with these ZeRO, offload, micro-batch and
    chunk settings; colocated, with rollout.colocate (and `push` as rollout.sglang.weight_sync, servers
    of `tp` GPUs, whose weights stay beside the trainer under LoRA)."""
    trainer = {"nproc": ranks // nodes, "nodes": nodes, "zero_stage": stage, "offload_optimizer": opt,
               "offload_params": par, "max_tokens_per_microbatch": micro, "logprob_chunk_tokens": chunk,
               "gpu_memory_gib": machine.gpu_memory_gib}
    if colocated:  # the plan then counts the released servers beside it, and the offloaded state
        rollout: dict = {"colocate": True}
        sglang: dict = {} if push is None else {"weight_sync": push}  # by handle: rank 0's copy on the host
        if tp is not None:
            sglang.update(tp_size=tp, num_servers=ranks // tp)
        if sglang:
            rollout["sglang"] = recipe.rollout.sglang.model_copy(update=sglang)
        return with_fields(recipe, trainer=trainer, rollout=rollout)
    return with_fields(recipe, trainer=trainer)


def rollout_variant(recipe: Recipe, machine: Machine, gpus: int, nodes: int, tp: int, frac: float) -> Recipe:
    """The recipe's rollouts on `gpus` GPUs over `nodes` nodes: servers of `tp` GPUs, one model copy
    each, SGLang's pool `frac` of a GPU."""
    s = recipe.rollout.sglang.model_copy(update={
        "tp_size": tp, "dp_size": 1, "num_servers": gpus // tp, "nodes": nodes, "mem_fraction_static": frac,
        "host": "127.0.0.1" if machine.nodes == 1 else "0.0.0.0"})
    return with_fields(recipe, trainer={"gpu_memory_gib": machine.gpu_memory_gib}, rollout={"sglang": s})
