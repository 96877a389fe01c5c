"""What `rlrecipe fit` searches and returns: the machine, a training option, a rollout option, a layout
of both, and the answer (fit.py, fit_search.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlrecipe.checks.step_time import Rollout, Training
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe


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
