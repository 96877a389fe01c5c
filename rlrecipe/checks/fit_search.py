"""`rlrecipe fit`'s search: the layouts of one recipe on one machine, each planned as `rlrecipe plan`
would (plan.py) and timed by the step-time model (step_time.py, colocate.py), the best of each split
kept (fit.py says what is searched and how it is ranked)."""

from __future__ import annotations

from rlrecipe.checks import fit_space
from rlrecipe.checks.colocate import (
    ASSUMED,
    PhaseCosts,
    allowed_pushes,
    cheapest_push,
    colocated_training,
    phase_seconds,
    push_seconds,
)
from rlrecipe.checks.fit_layout import Layout, Machine, RolloutOption, TrainOption
from rlrecipe.checks.fit_space import (
    COLOCATED_LORA_ZERO,
    COLOCATED_ZERO,
    ZERO,
    chunk_candidates,
    microbatch_candidates,
)
from rlrecipe.checks.host_disk import footprint
from rlrecipe.checks.memory import lora_params
from rlrecipe.checks.model_dims import BYTES, GIB, ModelDims, kv_bytes, model_dims
from rlrecipe.checks.plan import rollout_budget, sglang_memory, train_budget, trainer_kept_bytes
from rlrecipe.checks.step_time import Lengths, Rates, rollout_step, training_step, weight_load_s
from rlrecipe.recipe.schema import LoadedRecipe

# Of each GPU's memory, what a layout leaves unplanned beyond the plan's own reserve (1 GiB + 5%):
# the plan's figures are within a few percent of measured peaks (docs/gpu.md), not exact.
FIT_MARGIN = 0.05


class Search:
    """The layouts of one recipe on one machine (see the module docstring)."""

    def __init__(self, loaded: LoadedRecipe, machine: Machine, dims: ModelDims | None = None,
                 costs: PhaseCosts = ASSUMED):
        self.loaded, self.machine, self.costs = loaded, machine, costs
        r = self.recipe = loaded.recipe
        self.dims = dims or model_dims(loaded)
        self.adapter = lora_params(r, self.dims)  # trainer.lora: what trains and is pushed; None: everything
        self.lengths = Lengths.assumed(r.rollout.max_new_tokens, r.data.max_prompt_tokens)
        self.rates = Rates.of(self.dims, r.rollout.dtype, r.model.gradient_checkpointing,
                              train_seq_len=self.lengths.sequence, kv_bytes=kv_bytes(r.rollout),
                              lora=self.adapter is not None)
        self.allowed = allowed_pushes(colocated=True, lora=self.adapter is not None)  # colocated pushes
        self.c3po = r.rl.c3po.enabled
        self.rollouts = r.rl.prompts_per_step * r.rl.samples_per_prompt
        self.trained = (float(r.rl.c3po.token_budget) if self.c3po else self.rollouts * self.lengths.mean)
        self.gpu = machine.gpu_memory_gib * GIB
        self.limit = self.gpu * (1 - FIT_MARGIN)
        # colocated under LoRA, what each rank keeps on its GPU beside the servers (ZeRO-3 over the node)
        shared = fit_space.train_variant(r, machine, machine.gpus, 1, 3, False, False, 0, 0, colocated=True)
        self.kept_gib = trainer_kept_bytes(shared, self.dims) / GIB

    # -- the two sides -----------------------------------------------------------------------------
    def train_option(self, ranks: int, nodes: int, stage: int, opt: bool, par: bool, micro: int,
                     chunk: int, colocated: bool = False, push_s: float = 0.0, push: str | None = None,
                     tp: int | None = None) -> TrainOption:
        """`push_s`: colocated, the push's seconds (they depend on the servers: push_seconds); `push`:
        its kind (rollout.sglang.weight_sync), None for the source's; `tp`: the servers' (their weights
        stay beside the trainer under LoRA), None for the source's."""
        variant = fit_space.train_variant(self.recipe, self.machine, ranks, nodes, stage, opt, par, micro, chunk,
                                          colocated, push, tp)
        peak = train_budget(variant, self.dims).total
        host = sum(footprint(variant, self.dims).host.values())
        if par:  # ZeRO-3's offloaded parameters: a node's share of the 16-bit weights in host memory
            host += BYTES[variant.model.dtype] * self.dims.params() / nodes
        time = training_step(self.rates, self.dims, trained_tokens=self.trained, ranks=ranks, nodes=nodes,
                             dtype=variant.model.dtype, zero_stage=stage, offload_optimizer=opt,
                             offload_params=par, microbatch_tokens=micro, chunk_tokens=chunk,
                             minibatches=variant.rl.ppo_minibatches, trained_params=self.adapter)
        if colocated:
            time = colocated_training(time, phase_seconds(
                self.dims, dtype=variant.model.dtype, ranks=ranks, offload_optimizer=opt, offload_params=par,
                push_s=push_s, zero_stage=stage, costs=self.costs, adapter=self.adapter))
        return TrainOption(ranks, nodes, stage, opt, par, micro, chunk, peak, host, time)

    def train_options(self, ranks: int, nodes: int, colocated: bool = False, push_s: float = 0.0,
                      push: str | None = None, tp: int | None = None) -> list[TrainOption]:
        zero = (COLOCATED_ZERO if self.adapter is None else COLOCATED_LORA_ZERO) if colocated else ZERO
        return [self.train_option(ranks, nodes, stage, opt, par, micro, chunk, colocated, push_s, push, tp)
                for stage, opt, par in zero
                for micro in microbatch_candidates(self.recipe) for chunk in chunk_candidates(self.recipe)]

    def train_fits(self, o: TrainOption) -> bool:
        host = self.machine.host_memory_gib
        return o.peak <= self.limit and (host is None or o.host <= host * GIB)

    def tp_candidates(self, gpus: int) -> list[int]:
        return fit_space.tp_candidates(self.dims, self.machine, gpus)

    def fractions(self, colocated: bool = False) -> list[float]:
        return fit_space.fractions(self.machine, colocated, self.kept_gib)

    def rollout_option(self, gpus: int, nodes: int, tp: int, frac: float) -> RolloutOption | None:
        variant = fit_space.rollout_variant(self.recipe, self.machine, gpus, nodes, tp, frac)
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

    def rollout_options(self, gpus: int, nodes: int, colocated: bool = False) -> list[RolloutOption]:
        found = (self.rollout_option(gpus, nodes, tp, f) for tp in self.tp_candidates(gpus)
                 for f in self.fractions(colocated))
        return [o for o in found if o is not None]

    def sglang_headroom_gib(self, layout: Layout) -> float:
        """GiB a layout has to spare beyond SGLang's assumed memory outside its pool: how much more than
        SGLANG_OUTSIDE_POOL_GIB a server could keep there before this layout stops fitting. On rollout
        GPUs what the memory fraction leaves beyond the allowance; colocated, the least of that (with
        the offloaded trainer beside it) and the training phase's room under the limit."""
        left = (1 - layout.rollout.mem_fraction) * self.gpu / GIB
        rollout_phase = left - fit_space.outside_pool_gib(layout.colocated, self.kept_gib)
        if not layout.colocated:
            return rollout_phase
        return min(rollout_phase, (self.limit - layout.train.peak) / GIB)

    # -- layouts -----------------------------------------------------------------------------------
    def splits(self) -> list[tuple[int, int, int, int]]:
        """(training GPUs, their nodes, rollout GPUs, their nodes): GPUs inside one node, whole
        nodes across several (a launched server takes GPUs after the trainer's on its node)."""
        m = self.machine
        if m.nodes == 1:
            return [(t, 1, m.gpus - t, 1) for t in range(1, m.gpus)]
        return [(t * m.gpus, t, (m.nodes - t) * m.gpus, m.nodes - t) for t in range(1, m.nodes)]

    def layouts(self) -> list[Layout]:
        out = []
        for t_gpus, t_nodes, r_gpus, r_nodes in self.splits():
            trains = [o for o in self.train_options(t_gpus, t_nodes) if self.train_fits(o)]
            rollouts = self.rollout_options(r_gpus, r_nodes)
            if not trains or not rollouts:
                continue
            train = min(trains, key=lambda o: (o.time.seconds, o.peak))
            rollout = min(rollouts, key=lambda o: (o.time.seconds, o.tp, -o.mem_fraction))
            out.append(Layout(self.machine, train, rollout, split_step_seconds(self, train, rollout), self.trained,
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
                            costs=self.costs, pushes_per_run=self.recipe.rl.steps, params=self.adapter)

    def colocated_layouts(self) -> list[Layout]:
        """The best colocated layout: every GPU a trainer rank and (part of) an SGLang server, the new
        weights pushed by the cheapest built way into its servers (all three allowed: every server reads
        the trainer rank on its own GPU; under LoRA the adapter's two)."""
        if not self.can_colocate():
            return []
        gpus = self.machine.gpus
        rollouts = self.rollout_options(gpus, 1, colocated=True)
        if not rollouts:
            return []

        def push(o: RolloutOption) -> tuple[str, float]:
            seconds = self.pushes(o)
            kind = cheapest_push(seconds, self.allowed)
            return kind, seconds[kind]

        # the push depends on the servers and adds to the step, so it ranks the rollout options too
        rollout = min(rollouts, key=lambda o: (o.time.seconds + push(o)[1], o.tp, -o.mem_fraction))
        kind, push_s = push(rollout)
        trains = [o for o in self.train_options(gpus, 1, colocated=True, push_s=push_s, push=kind, tp=rollout.tp)
                  if self.train_fits(o)]
        if not trains:
            return []
        train = min(trains, key=lambda o: (o.time.seconds, o.peak))
        return [Layout(self.machine, train, rollout, rollout.time.seconds + train.time.seconds, self.trained,
                       self.recipe.rl.steps, colocated=True, push=kind)]


def split_step_seconds(search: Search, train: TrainOption, rollout: RolloutOption) -> float:
    """A split layout's step: rollout then training, or, asynchronous, the longer of the two (the rollout
    side pausing to load the pushed weights)."""
    if search.recipe.rl.async_lag:
        load = weight_load_s(search.dims, search.recipe.rollout.dtype, params=search.adapter)
        return max(rollout.time.seconds + load, train.time.seconds)
    return rollout.time.seconds + train.time.seconds
