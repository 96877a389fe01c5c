"""`rlrecipe fit`: lay a recipe out on the GPUs at hand without changing what it trains.

Searched: the rollout/training split (whole nodes across nodes, GPUs inside one) and, on one node,
the colocated layout (every GPU shared, rollout and training taking turns: colocate.py, with the
cheapest of its three built weight pushes: by value, over disk or by handle), SGLang's
tensor parallelism and memory fraction, the ZeRO stage and CPU offload, micro-batch tokens (hence the
gradient accumulation) and the log-prob chunk. Kept: the layouts whose `rlrecipe plan` budgets fit
with FIT_MARGIN to spare (and the host memory, when given). Ranked: projected seconds per trained
token (`step_time.py`). Every field fit changes is outside the recipe's algorithm sha256, so the
fitted recipe trains the same thing (docs/gpu.md, "How fit decides").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlrecipe.checks.colocate import (
    ASSUMED,
    SGLANG_OUTSIDE_POOL_GIB,
    TRAINER_OFFLOADED_GIB,
    PhaseCosts,
    allowed_pushes,
    cheapest_push,
    colocated_training,
    phase_seconds,
    push_seconds,
)
from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims, kv_bytes, model_dims
from rlrecipe.checks.plan import rank0_host_parts, rollout_budget, sglang_memory, stage_of, train_budget
from rlrecipe.checks.step_time import (
    Lengths,
    Rates,
    Rollout,
    Training,
    rollout_step,
    training_step,
    weight_load_s,
)
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe, Recipe

# Of each GPU's memory, what a layout leaves unplanned beyond the plan's own reserve (1 GiB + 5%):
# the plan's figures are within a few percent of measured peaks (docs/gpu.md), not exact.
FIT_MARGIN = 0.05
# SGLang's activations, CUDA graphs and sampler live outside its static pool: at least
# SGLANG_OUTSIDE_POOL_GIB of a GPU stays outside it (colocate.py). Colocated, the offloaded trainer
# stays too, so smaller fractions are tried there (a small card has little room beside the pool).
MEM_FRACTIONS = (0.9, 0.85, 0.8, 0.75, 0.7)
COLOCATED_FRACTIONS = MEM_FRACTIONS + (0.65, 0.6, 0.55, 0.5)
TP_SIZES = (1, 2, 4, 8)
ZERO = ((3, False, False), (2, False, False), (1, False, False), (3, True, False), (2, True, False),
        (1, True, False), (3, True, True))
# Colocated: ZeRO-3 only, whose ranks hold the least while offloaded and reload the least (the trainer
# hands ZeRO-3's optimizer state over with DeepSpeed's FusedAdam on CUDA)
COLOCATED_ZERO = tuple(z for z in ZERO if z[0] == 3)
CHUNK_DIVISORS = (1, 2, 4)
# Card sizes and machines tried for "the smallest hardware that fits" (GiB; GPUs per node, nodes).
CARDS_GIB = (24, 40, 48, 80, 96, 141)
MACHINES = ((2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8), (8, 16))


class FitError(UserError):
    """Bad arguments to fit, or a recipe it cannot lay out: one line, exit code 2."""


@dataclass(frozen=True)
class Machine:
    gpus: int  # per node
    nodes: int = 1
    gpu_memory_gib: float = 80.0
    host_memory_gib: float | None = None  # per node; None: not checked

    @property
    def total(self) -> int:
        return self.gpus * self.nodes

    @property
    def label(self) -> str:
        mem = f"{self.gpu_memory_gib:g} GB"
        return f"{self.nodes} x {self.gpus} x {mem}" if self.nodes > 1 else f"{self.gpus} x {mem}"


def check_machine(gpus: int, nodes: int, gpu_memory_gib: float, host_memory_gib: float | None) -> Machine:
    if gpus < 1:
        raise FitError(f"--gpus {gpus}: needs at least 1 GPU per node")
    if nodes < 1:
        raise FitError(f"--nodes {nodes}: needs at least 1 node")
    if not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib)):
        raise FitError(f"--gpu-memory {gpu_memory_gib}: a GPU's memory in GiB must be a positive number")
    if host_memory_gib is not None and not (host_memory_gib > 0 and math.isfinite(host_memory_gib)):
        raise FitError(f"--host-memory {host_memory_gib}: a node's memory in GiB must be a positive number")
    return Machine(gpus, nodes, gpu_memory_gib, host_memory_gib)


@dataclass
class TrainOption:
    ranks: int
    nodes: int
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    microbatch_tokens: int
    chunk_tokens: int
    peak: float  # bytes per GPU, as `rlrecipe plan` counts them
    host: float  # bytes of host memory on node 0
    time: Training

    @property
    def zero(self) -> str:
        off = [name for name, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params)) if on]
        return f"ZeRO-{self.zero_stage}" + (f", {' and '.join(off)} offloaded" if off else "")

    @property
    def label(self) -> str:
        """Compact: Z<stage>[+o offloaded optimizer][+p parameters] <micro-batch>k x <micro-batches
        per rank per minibatch> c<chunk>."""
        off = ("+o" if self.offload_optimizer else "") + ("+p" if self.offload_params else "")
        return (f"Z{self.zero_stage}{off} {self.microbatch_tokens // 1024}k x {self.time.microbatches}"
                f" c{self.chunk_tokens}")


@dataclass
class RolloutOption:
    gpus: int
    nodes: int
    tp: int
    mem_fraction: float
    kv_tokens: int
    pool: float  # bytes per GPU: SGLang's static pool
    time: Rollout

    @property
    def servers(self) -> int:
        return self.gpus // self.tp

    @property
    def label(self) -> str:
        return f"{self.servers} x tp{self.tp} @{self.mem_fraction:.2f}"


@dataclass
class Layout:
    machine: Machine
    train: TrainOption
    rollout: RolloutOption
    step_s: float
    trained_tokens: float
    steps: int
    colocated: bool = False  # every GPU both rolls out and trains (train.time holds the phase changes)
    push: str | None = None  # colocated: the weight push costed, rollout.sglang.weight_sync ("tensor", "disk", "ipc")

    @property
    def s_per_mtoken(self) -> float:
        return 1e6 * self.step_s / self.trained_tokens

    @property
    def hours(self) -> float:
        return self.step_s * self.steps / 3600

    @property
    def split(self) -> str:
        if self.colocated:
            return f"{self.train.ranks} shared"
        if self.machine.nodes > 1:
            return f"{self.train.nodes} + {self.rollout.nodes} nodes"
        return f"{self.train.ranks} + {self.rollout.gpus}"


@dataclass
class Fit:
    source: LoadedRecipe
    machine: Machine
    layouts: list[Layout]  # best first
    refusal: str | None = None


def _with(recipe: Recipe, **sections: dict) -> Recipe:
    """The recipe with some fields of some sections replaced, unvalidated (the search's variants)."""
    update = {name: getattr(recipe, name).model_copy(update=fields) for name, fields in sections.items()}
    return recipe.model_copy(update=update)


def _needs(loaded: LoadedRecipe) -> None:
    r = loaded.recipe
    if stage_of(r) != "rl" or r.rollout.engine != "sglang" or r.trainer.engine != "deepspeed":
        raise FitError(f"{loaded.path}: fit lays out RL recipes that train with DeepSpeed and roll out on SGLang "
                       f"(this one: stage {stage_of(r)}, trainer.engine {r.trainer.engine}, "
                       f"rollout.engine {r.rollout.engine})")


class Search:
    """The layouts of one recipe on one machine (see the module docstring)."""

    def __init__(self, loaded: LoadedRecipe, machine: Machine, dims: ModelDims | None = None,
                 costs: PhaseCosts = ASSUMED):
        self.loaded, self.machine, self.costs = loaded, machine, costs
        r = self.recipe = loaded.recipe
        self.dims = dims or model_dims(loaded)
        self.rates = Rates.of(self.dims, r.rollout.dtype, r.model.gradient_checkpointing,
                              kv_bytes=kv_bytes(r.rollout))
        self.lengths = Lengths.assumed(r.rollout.max_new_tokens, r.data.max_prompt_tokens)
        self.c3po = r.rl.c3po.enabled
        self.rollouts = r.rl.prompts_per_step * r.rl.samples_per_prompt
        self.trained = (float(r.rl.c3po.token_budget) if self.c3po else self.rollouts * self.lengths.mean)
        self.gpu = machine.gpu_memory_gib * GIB
        self.limit = self.gpu * (1 - FIT_MARGIN)

    # -- the two sides -----------------------------------------------------------------------------
    def microbatch_candidates(self) -> list[int]:
        """The source's micro-batch, and the smallest that holds one full-length sequence."""
        r = self.recipe
        seq = r.data.max_prompt_tokens + r.rollout.max_new_tokens
        least = 1024 * math.ceil(seq / 1024)
        return sorted({r.trainer.max_tokens_per_microbatch, least}, reverse=True)

    def chunk_candidates(self) -> list[int]:
        c = self.recipe.trainer.logprob_chunk_tokens
        return sorted({max(128, c // k) for k in CHUNK_DIVISORS}, reverse=True)

    def train_variant(self, ranks: int, nodes: int, stage: int, opt: bool, par: bool, micro: int,
                      chunk: int, colocated: bool = False, push: str | None = None) -> Recipe:
        trainer = {"nproc": ranks // nodes, "nodes": nodes, "zero_stage": stage, "offload_optimizer": opt,
                   "offload_params": par, "max_tokens_per_microbatch": micro, "logprob_chunk_tokens": chunk,
                   "gpu_memory_gib": self.machine.gpu_memory_gib}
        if colocated:  # the plan then counts the released servers beside it, and the offloaded state
            rollout: dict = {"colocate": True}
            if push is not None:  # and, pushed by handle, rank 0's copy of the weights kept on the host
                rollout["sglang"] = self.recipe.rollout.sglang.model_copy(update={"weight_sync": push})
            return _with(self.recipe, trainer=trainer, rollout=rollout)
        return _with(self.recipe, trainer=trainer)

    def train_option(self, ranks: int, nodes: int, stage: int, opt: bool, par: bool, micro: int,
                     chunk: int, colocated: bool = False, push_s: float = 0.0, push: str | None = None) -> TrainOption:
        """`push_s`: colocated, the push's seconds (they depend on the servers: push_seconds); `push`:
        its kind (rollout.sglang.weight_sync), None for the source's."""
        variant = self.train_variant(ranks, nodes, stage, opt, par, micro, chunk, colocated, push)
        peak = train_budget(variant, self.dims).total
        host = sum(rank0_host_parts(variant, self.dims).values())
        if par:  # ZeRO-3's offloaded parameters: a node's share of the 16-bit weights in host memory
            host += BYTES[variant.model.dtype] * self.dims.params() / nodes
        time = training_step(self.rates, self.dims, trained_tokens=self.trained, ranks=ranks, nodes=nodes,
                             dtype=variant.model.dtype, zero_stage=stage, offload_optimizer=opt,
                             offload_params=par, microbatch_tokens=micro, chunk_tokens=chunk,
                             minibatches=variant.rl.ppo_minibatches)
        if colocated:
            time = colocated_training(time, phase_seconds(
                self.dims, dtype=variant.model.dtype, ranks=ranks, offload_optimizer=opt, offload_params=par,
                push_s=push_s, zero_stage=stage, costs=self.costs))
        return TrainOption(ranks, nodes, stage, opt, par, micro, chunk, peak, host, time)

    def train_options(self, ranks: int, nodes: int, colocated: bool = False, push_s: float = 0.0,
                      push: str | None = None) -> list[TrainOption]:
        return [self.train_option(ranks, nodes, stage, opt, par, micro, chunk, colocated, push_s, push)
                for stage, opt, par in (COLOCATED_ZERO if colocated else ZERO)
                for micro in self.microbatch_candidates() for chunk in self.chunk_candidates()]

    def train_fits(self, o: TrainOption) -> bool:
        host = self.machine.host_memory_gib
        return o.peak <= self.limit and (host is None or o.host <= host * GIB)

    def tp_candidates(self, gpus: int) -> list[int]:
        d = self.dims
        return [tp for tp in TP_SIZES if tp <= self.machine.gpus and gpus % tp == 0
                and d.heads % tp == 0 and d.kv_heads % tp == 0]

    def rollout_variant(self, gpus: int, nodes: int, tp: int, frac: float) -> Recipe:
        single = self.machine.nodes == 1
        return _with(self.recipe, trainer={"gpu_memory_gib": self.machine.gpu_memory_gib},
                     rollout=self._rollout_section(gpus, nodes, tp, frac, single))

    def _rollout_section(self, gpus: int, nodes: int, tp: int, frac: float, single: bool) -> dict:
        s = self.recipe.rollout.sglang.model_copy(update={
            "tp_size": tp, "dp_size": 1, "num_servers": gpus // tp, "nodes": nodes, "mem_fraction_static": frac,
            "host": "127.0.0.1" if single else "0.0.0.0"})
        return {"sglang": s}

    def rollout_option(self, gpus: int, nodes: int, tp: int, frac: float) -> RolloutOption | None:
        variant = self.rollout_variant(gpus, nodes, tp, frac)
        budget = rollout_budget(variant, self.dims, "rl")
        if not budget.fits:
            return None
        pool, _, kv, kv_token = sglang_memory(variant, self.dims)
        kv_tokens = int(kv // kv_token)
        r = variant.rl
        time = rollout_step(self.rates, self.lengths, engines=gpus // tp, tp=tp, kv_tokens=kv_tokens,
                            rollouts=self.rollouts, max_concurrency=variant.rollout.sglang.max_concurrency,
                            c3po_budget=r.c3po.token_budget if self.c3po else None,
                            c3po_pool=r.c3po.pool_capacity)
        return RolloutOption(gpus, nodes, tp, frac, kv_tokens, pool, time)

    def fractions(self, colocated: bool = False) -> list[float]:
        """Memory fractions that leave SGLang's outside-the-pool allowance free (and, colocated, the
        offloaded trainer's)."""
        outside = SGLANG_OUTSIDE_POOL_GIB + (TRAINER_OFFLOADED_GIB if colocated else 0.0)
        room = outside / self.machine.gpu_memory_gib
        return [f for f in (COLOCATED_FRACTIONS if colocated else MEM_FRACTIONS) if 1 - f >= room - 1e-9]

    def rollout_options(self, gpus: int, nodes: int, colocated: bool = False) -> list[RolloutOption]:
        found = (self.rollout_option(gpus, nodes, tp, f) for tp in self.tp_candidates(gpus)
                 for f in self.fractions(colocated))
        return [o for o in found if o is not None]

    # -- layouts -----------------------------------------------------------------------------------
    def splits(self) -> list[tuple[int, int, int, int]]:
        """(training GPUs, their nodes, rollout GPUs, their nodes): GPUs inside one node, whole
        nodes across several (a launched server takes GPUs after the trainer's on its node)."""
        m = self.machine
        if m.nodes == 1:
            return [(t, 1, m.gpus - t, 1) for t in range(1, m.gpus)]
        return [(t * m.gpus, t, (m.nodes - t) * m.gpus, m.nodes - t) for t in range(1, m.nodes)]

    def step_seconds(self, train: TrainOption, rollout: RolloutOption) -> float:
        if self.recipe.rl.async_lag:
            load = weight_load_s(self.dims, self.recipe.rollout.dtype)
            return max(rollout.time.seconds + load, train.time.seconds)
        return rollout.time.seconds + train.time.seconds

    def layouts(self) -> list[Layout]:
        out = []
        for t_gpus, t_nodes, r_gpus, r_nodes in self.splits():
            trains = [o for o in self.train_options(t_gpus, t_nodes) if self.train_fits(o)]
            rollouts = self.rollout_options(r_gpus, r_nodes)
            if not trains or not rollouts:
                continue
            train = min(trains, key=lambda o: (o.time.seconds, o.peak))
            rollout = min(rollouts, key=lambda o: (o.time.seconds, o.tp, -o.mem_fraction))
            out.append(Layout(self.machine, train, rollout, self.step_seconds(train, rollout), self.trained,
                              self.recipe.rl.steps))
        out += self.colocated_layouts()
        return sorted(out, key=lambda lay: lay.s_per_mtoken)

    def can_colocate(self) -> bool:
        """One node (servers the run launches itself), and no asynchronous lag (turns overlap nothing)."""
        return self.machine.nodes == 1 and not self.recipe.rl.async_lag

    def pushes(self, rollout: RolloutOption) -> dict[str, float]:
        """Seconds of one colocated push into this rollout option's servers, by each way (push_seconds),
        a push's one-time cost spread over the run's rl.steps."""
        return push_seconds(self.dims, self.recipe.rollout.dtype, servers=rollout.servers, tp=rollout.tp,
                            nodes=rollout.nodes, bucket_bytes=self.recipe.rollout.sglang.weight_sync_bucket_mb << 20,
                            costs=self.costs, pushes_per_run=self.recipe.rl.steps)

    def colocated_layouts(self) -> list[Layout]:
        """The best colocated layout: every GPU a trainer rank and (part of) an SGLang server, the new
        weights pushed by the cheapest built way into its servers (all three allowed: every server reads
        the trainer rank on its own GPU)."""
        if not self.can_colocate():
            return []
        gpus = self.machine.gpus
        rollouts = self.rollout_options(gpus, 1, colocated=True)
        if not rollouts:
            return []

        def push(o: RolloutOption) -> tuple[str, float]:
            seconds = self.pushes(o)
            kind = cheapest_push(seconds, allowed_pushes(colocated=True))
            return kind, seconds[kind]

        # the push depends on the servers and adds to the step, so it ranks the rollout options too
        rollout = min(rollouts, key=lambda o: (o.time.seconds + push(o)[1], o.tp, -o.mem_fraction))
        kind, push_s = push(rollout)
        trains = [o for o in self.train_options(gpus, 1, colocated=True, push_s=push_s, push=kind)
                  if self.train_fits(o)]
        if not trains:
            return []
        train = min(trains, key=lambda o: (o.time.seconds, o.peak))
        return [Layout(self.machine, train, rollout, rollout.time.seconds + train.time.seconds, self.trained,
                       self.recipe.rl.steps, colocated=True, push=kind)]

    # -- saying no ---------------------------------------------------------------------------------
    def first_failure(self) -> str:
        m = self.machine
        shared = self.colocated_failure() if self.can_colocate() else None
        if m.total < 2:
            if shared is None:  # an asynchronous lag: rollout and training must overlap
                return (f"rl.async_lag {self.recipe.rl.async_lag}: rollout and training run at once, so they need "
                        "GPUs of their own, and one GPU cannot be split")
            return shared
        split = self.split_failure()
        return split if shared is None else f"{split}; {shared}"

    def colocated_failure(self) -> str:
        """Why no colocated layout fits, with the numbers."""
        m, d = self.machine, self.dims
        head = f"{d.params() / 1e9:.1f}B colocated on {m.label}"
        trains = self.train_options(m.gpus, 1, colocated=True)
        best = min(trains, key=lambda o: o.peak)
        if best.peak > self.limit:
            return (f"{head}: the training phase needs {best.peak / GIB:.1f} GiB per GPU > {self.limit / GIB:.1f} "
                    f"usable ({FIT_MARGIN:.0%} kept free) at its least ({best.label}, with "
                    f"{SGLANG_OUTSIDE_POOL_GIB:g} GiB the released SGLang keeps)")
        if not any(self.train_fits(o) for o in trains):
            least = min((o for o in trains if o.peak <= self.limit), key=lambda o: o.host)
            return (f"{head}: host memory needs {least.host / GIB:.0f} GiB ({least.label}: the offloaded trainer "
                    f"state pinned, and rank 0's) > {m.host_memory_gib:g}")
        seq = self.recipe.data.max_prompt_tokens + self.recipe.rollout.max_new_tokens
        fractions = self.fractions(colocated=True)
        outside = SGLANG_OUTSIDE_POOL_GIB + TRAINER_OFFLOADED_GIB
        if not fractions:
            return (f"{head}: the rollout phase needs {outside:g} GiB outside SGLang's pool (its own "
                    f"{SGLANG_OUTSIDE_POOL_GIB:g}, the offloaded trainer's {TRAINER_OFFLOADED_GIB:g}) and a pool of "
                    f"at least {min(COLOCATED_FRACTIONS):.2f} x {m.gpu_memory_gib:g} GiB")
        b = BYTES[self.recipe.rollout.dtype]
        weights = b * d.params() / GIB
        one_seq = seq * 2 * d.layers * d.kv_dim * b / GIB
        return (f"{head}: the rollout phase needs the weights ({weights:.1f} GiB at tp 1) and one {seq}-token "
                f"sequence's KV cache ({one_seq:.1f} GiB) in a pool of at most {max(fractions):.2f} x "
                f"{m.gpu_memory_gib:g} = {max(fractions) * m.gpu_memory_gib:.1f} GiB ({outside:g} GiB kept outside it)")

    def split_failure(self) -> str:
        m = self.machine
        splits = self.splits()
        trains = [o for t, tn, _, _ in splits for o in self.train_options(t, tn)]
        if not any(o.peak <= self.limit for o in trains):
            best = min(trains, key=lambda o: o.peak)
            return (f"training does not fit: at least {best.peak / GIB:.1f} GiB per GPU ({best.label} on "
                    f"{best.ranks} GPU{'s' if best.ranks > 1 else ''}), of {self.limit / GIB:.1f} GiB usable ({FIT_MARGIN:.0%} kept free)")
        if not any(self.train_fits(o) for o in trains):
            best = min((o for o in trains if o.peak <= self.limit), key=lambda o: o.host)
            return (f"host memory does not fit: at least {best.host / GIB:.0f} GiB on node 0 ({best.label}), "
                    f"of {m.host_memory_gib:g}")
        seq = self.recipe.data.max_prompt_tokens + self.recipe.rollout.max_new_tokens
        if not self.fractions():
            return (f"rollout does not fit: SGLang needs {SGLANG_OUTSIDE_POOL_GIB:g} GiB of a GPU outside its "
                    "static pool, and room inside it for the weights and the KV cache")
        rollouts = [g for _, _, g, n in splits if self.rollout_options(g, n)]
        if not rollouts:
            return (f"rollout does not fit: no SGLang layout of the GPUs left holds the weights and one "
                    f"{seq}-token sequence's KV cache (memory fraction at most {max(self.fractions()):.2f})")
        fitting = [o.ranks for o in trains if self.train_fits(o)]
        return (f"no split leaves both sides room: training fits on {min(fitting)} GPUs or more, rollout on "
                f"{min(rollouts)} or more, of {m.total}")


def smallest_fitting(loaded: LoadedRecipe, dims: ModelDims, card_gib: float,
                     host_gib: float | None = None) -> list[Machine]:
    """The fewest GPUs of this card size that fit, and the machine with the least GPU memory in all
    (of MACHINES x CARDS_GIB, nodes of `host_gib`), if that is another."""
    def fits(machine: Machine) -> bool:
        return bool(Search(loaded, machine, dims).layouts())

    def first(cards) -> Machine | None:
        tried = sorted((Machine(g, n, c, host_gib) for c in cards for g, n in MACHINES), key=lambda m: (m.total * m.gpu_memory_gib,
                                                                                             m.total))
        return next((m for m in tried if fits(m)), None)

    found = [m for m in (first([card_gib]), first(CARDS_GIB)) if m is not None]
    return list(dict.fromkeys(found))


def fit(loaded: LoadedRecipe, machine: Machine) -> Fit:
    _needs(loaded)
    search = Search(loaded, machine)
    layouts = search.layouts()
    if layouts:
        return Fit(loaded, machine, layouts)
    smallest = smallest_fitting(loaded, search.dims, machine.gpu_memory_gib, machine.host_memory_gib)
    host = f" with {machine.host_memory_gib:g} GiB a node" if machine.host_memory_gib is not None else ""
    hint = (f" Smallest that fits{host}: " + ", or ".join(m.label for m in smallest) + "." if smallest
            else " Nothing up to 16 x 8 x 141 GB fits.")
    return Fit(loaded, machine, [], refusal=f"{loaded.path} does not fit {machine.label}: {search.first_failure()}."
               + hint)
