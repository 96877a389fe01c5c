"""`rlrecipe fit`: lay a recipe out on the GPUs at hand without changing what it trains.

Searched (fit_search.py, over fit_space.py's values): the rollout/training split (whole nodes across
nodes, GPUs inside one) and, on one node, the colocated layout (every GPU shared, rollout and training
taking turns: colocate.py, with the cheapest of its three built weight pushes: by value, over disk or
by handle), SGLang's tensor parallelism and memory fraction, the ZeRO stage and CPU offload,
micro-batch tokens (hence the gradient accumulation) and the log-prob chunk. Kept: the layouts whose
`rlrecipe plan` budgets fit with FIT_MARGIN to spare (and the host memory, when given). Ranked:
projected seconds per trained token (`step_time.py`). Nothing fits: why, and the smallest machines
that would (fit_refusal.py). Every field fit changes is outside the recipe's algorithm sha256, so the
fitted recipe trains the same thing (docs/gpu.md, "How fit decides"); fit_recipe.py writes it.
"""

from __future__ import annotations

from rlrecipe.checks.fit_layout import Fit, FitError, Machine
from rlrecipe.checks.fit_refusal import first_failure, smallest_fitting
from rlrecipe.checks.fit_search import Search
from rlrecipe.checks.memory import stage_of
from rlrecipe.recipe.schema import LoadedRecipe


def _needs(loaded: LoadedRecipe) -> None:
    r = loaded.recipe
    if stage_of(r) != "rl" or r.rollout.engine != "sglang" or r.trainer.engine != "deepspeed":
        raise FitError(f"{loaded.path}: fit lays out RL recipes that train with DeepSpeed and roll out on SGLang "
                       f"(this one: stage {stage_of(r)}, trainer.engine {r.trainer.engine}, "
                       f"rollout.engine {r.rollout.engine})")


def fit(loaded: LoadedRecipe, machine: Machine) -> Fit:
    """The recipe's layouts on this machine, best first, or a refusal saying why none fits."""
    _needs(loaded)
    search = Search(loaded, machine)
    layouts = search.layouts()
    if layouts:
        return Fit(loaded, machine, layouts)
    smallest = smallest_fitting(loaded, search.dims, machine.gpu_memory_gib, machine.host_memory_gib)
    host = f" with {machine.host_memory_gib:g} GiB a node" if machine.host_memory_gib is not None else ""
    hint = (f" Smallest that fits{host}: " + ", or ".join(m.label for m in smallest) + "." if smallest
            else " Nothing up to 16 x 8 x 141 GB fits.")
    return Fit(loaded, machine, [], refusal=f"{loaded.path} does not fit {machine.label}: {first_failure(search)}."
               + hint)
