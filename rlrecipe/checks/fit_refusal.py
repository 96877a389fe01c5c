"""`rlrecipe fit` saying no: what fails first on this machine, with the numbers, and the smallest
machines that would fit (docs/gpu.md, "Saying no")."""

from __future__ import annotations

from rlrecipe.checks.fit_layout import Machine
from rlrecipe.checks.fit_search import FIT_MARGIN, Search
from rlrecipe.checks.fit_space import COLOCATED_FRACTIONS
from rlrecipe.checks.memory import SGLANG_OUTSIDE_POOL_GIB, TRAINER_OFFLOADED_GIB
from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims
from rlrecipe.recipe.schema import LoadedRecipe

# Card sizes and machines tried for "the smallest hardware that fits" (GiB; GPUs per node, nodes): one
# GPU first, since a colocated layout can fit a recipe on a single card.
CARDS_GIB = (16, 24, 40, 48, 80, 96, 141)
MACHINES = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8), (8, 16))


def first_failure(search: Search) -> str:
    """Why nothing fits: on one GPU, why no colocated layout does; on several, why no split does, then
    why no colocated layout does."""
    m = search.machine
    shared = colocated_failure(search) if search.can_colocate() else None
    if m.total < 2:
        if shared is None:  # an asynchronous lag: rollout and training must overlap
            return (f"rl.async_lag {search.recipe.rl.async_lag}: rollout and training run at once, so they need "
                    "GPUs of their own, and one GPU cannot be split")
        return shared
    split = split_failure(search)
    return split if shared is None else f"{split}; {shared}"


def colocated_failure(search: Search) -> str:
    """Why no colocated layout fits, with the numbers."""
    m, d, limit = search.machine, search.dims, search.limit
    head = f"{d.params() / 1e9:.1f}B colocated on {m.label}"
    lora = search.adapter is not None
    # under LoRA the released servers keep their weights: the widest servers keep the least per GPU
    tp = max(search.tp_candidates(m.gpus)) if lora else None
    trains = search.train_options(m.gpus, 1, colocated=True, tp=tp)
    best = min(trains, key=lambda o: o.peak)
    if best.peak > limit:
        keeps = (f"{SGLANG_OUTSIDE_POOL_GIB:g} GiB (unmeasured) the released SGLang keeps" if not lora else
                 f"the {SGLANG_OUTSIDE_POOL_GIB:g} GiB (unmeasured), weights and adapters the released SGLang keeps at tp {tp}, "
                 f"LoRA rank {search.recipe.trainer.lora.rank}")
        return (f"{head}: the training phase needs {best.peak / GIB:.1f} GiB per GPU > {limit / GIB:.1f} "
                f"usable ({FIT_MARGIN:.0%} kept free) at its least ({best.label}, with {keeps})")
    if not any(search.train_fits(o) for o in trains):
        least = min((o for o in trains if o.peak <= limit), key=lambda o: o.host)
        return (f"{head}: host memory needs {least.host / GIB:.0f} GiB ({least.label}: the offloaded trainer "
                f"state pinned, and rank 0's) > {m.host_memory_gib:g}")
    seq = search.recipe.data.max_prompt_tokens + search.recipe.rollout.max_new_tokens
    fractions = search.fractions(colocated=True)
    outside = SGLANG_OUTSIDE_POOL_GIB + TRAINER_OFFLOADED_GIB + search.kept_gib
    if not fractions:
        kept = f", the frozen base it keeps {search.kept_gib:.1f}" if lora else ""
        return (f"{head}: the rollout phase needs {outside:.3g} GiB outside SGLang's pool (its own "
                f"{SGLANG_OUTSIDE_POOL_GIB:g}, unmeasured, the offloaded trainer's {TRAINER_OFFLOADED_GIB:g}{kept}) and a pool of "
                f"at least {min(COLOCATED_FRACTIONS):.2f} x {m.gpu_memory_gib:g} GiB")
    b = BYTES[search.recipe.rollout.dtype]
    weights = b * d.params() / GIB
    one_seq = seq * d.kv_bytes_per_token(b) / GIB
    return (f"{head}: the rollout phase needs the weights ({weights:.1f} GiB at tp 1) and one {seq}-token "
            f"sequence's KV cache ({one_seq:.1f} GiB) in a pool of at most {max(fractions):.2f} x "
            f"{m.gpu_memory_gib:g} = {max(fractions) * m.gpu_memory_gib:.1f} GiB ({outside:.3g} GiB kept outside it)")


def split_failure(search: Search) -> str:
    """Why no split of the GPUs into training and rollout fits, with the numbers."""
    m, limit = search.machine, search.limit
    splits = search.splits()
    trains = [o for t, tn, _, _ in splits for o in search.train_options(t, tn)]
    if not any(o.peak <= limit for o in trains):
        best = min(trains, key=lambda o: o.peak)
        return (f"training does not fit: at least {best.peak / GIB:.1f} GiB per GPU ({best.label} on "
                f"{best.ranks} GPU{'s' if best.ranks > 1 else ''}), of {limit / GIB:.1f} GiB usable ({FIT_MARGIN:.0%} kept free)")
    if not any(search.train_fits(o) for o in trains):
        best = min((o for o in trains if o.peak <= limit), key=lambda o: o.host)
        return (f"host memory does not fit: at least {best.host / GIB:.0f} GiB on node 0 ({best.label}), "
                f"of {m.host_memory_gib:g}")
    seq = search.recipe.data.max_prompt_tokens + search.recipe.rollout.max_new_tokens
    if not search.fractions():
        return (f"rollout does not fit: SGLang needs {SGLANG_OUTSIDE_POOL_GIB:g} GiB (unmeasured) of a GPU outside its "
                "static pool, and room inside it for the weights and the KV cache")
    rollouts = [g for _, _, g, n in splits if search.rollout_options(g, n)]
    if not rollouts:
        return (f"rollout does not fit: no SGLang layout of the GPUs left holds the weights and one "
                f"{seq}-token sequence's KV cache (memory fraction at most {max(search.fractions()):.2f})")
    fitting = [o.ranks for o in trains if search.train_fits(o)]
    return (f"no split leaves both sides room: training fits on {min(fitting)} GPUs or more, rollout on "
            f"{min(rollouts)} or more, of {m.total}")


def smallest_fitting(loaded: LoadedRecipe, dims: ModelDims, card_gib: float,
                     host_gib: float | None = None) -> list[Machine]:
    """The fewest GPUs of this card size that fit, and the machine with the least GPU memory in all
    (of MACHINES x CARDS_GIB, nodes of `host_gib`), if that is another."""
    def fits(machine: Machine) -> bool:
        return bool(Search(loaded, machine, dims).layouts())

    def first(cards) -> Machine | None:
        tried = sorted((Machine(g, n, c, host_gib) for c in cards for g, n in MACHINES),
                       key=lambda m: (m.total * m.gpu_memory_gib, m.total))
        return next((m for m in tried if fits(m)), None)

    found = [m for m in (first([card_gib]), first(CARDS_GIB)) if m is not None]
    return list(dict.fromkeys(found))
