"""Rollout ahead of training (`rl.async_lag` = L >= 1): batches are collected on a worker thread while
the trainer trains.

The schedule, not timing, says which weights collect each batch: the batch trained at step s is
collected under the weights the trainer had at step s - L (the first L batches under the starting
weights). At the start of step s the trainer takes batch s and hands the worker the weights of step
s, to collect batch s + L with. Batches are collected one after another, in step order, by one
worker, so the pool, the prompt stream and every sampling seed see exactly what a synchronous run
with the same lag would: the same recipe and seed give the same tokens however long each side takes.

A checkpoint first waits for the worker (`drain`), then stores the batches collected and not yet
trained beside the pool that follows them; a resumed run puts them back (`restore`) and goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlrecipe.core.errors import UserError
from rlrecipe.rl.rollout_stats import RolloutStats
from rlrecipe.trajectory.arrays import TrajectoryBatch

PENDING_PREFIX = "pending_step_"


@dataclass
class Collected:
    """One graded batch, the step that trains it and the weights' version that collected it."""
    step: int
    batch: TrajectoryBatch
    roll: RolloutStats
    version: int
    seconds: float  # the worker's wall time collecting and grading it


def weights_version(step: int, lag: int, first: int = 0) -> int:
    """The trainer version whose weights collect the batch of `step`: step - lag, never before `first`."""
    return max(first, step - lag)


class RolloutAhead:
    """One worker thread that collects batches in step order; `install(weights, version)` loads
    weights into the engine on that thread, just before the batch that needs them."""

    def __init__(self, collect: Callable[[int], tuple[TrajectoryBatch, RolloutStats]],
                 install: Callable[[Any, int], None], version: Callable[[], int]):
        self._collect, self._install, self._version = collect, install, version
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self._jobs: dict[int, Future] = {}

    def schedule(self, step: int, weights: Any = None, version: int | None = None) -> None:
        """Collect the batch of `step` once the batches scheduled before it are done, after
        installing `weights` as `version` (None: under the weights the engine holds then)."""
        if step in self._jobs:
            raise RuntimeError(f"the batch of step {step} is already scheduled")
        self._jobs[step] = self._worker.submit(self._run, step, weights, version)

    def _run(self, step: int, weights: Any, version: int | None) -> Collected:
        if weights is not None:
            self._install(weights, version)
        t0 = time.time()
        batch, roll = self._collect(step)
        return Collected(step, batch, roll, self._version(), time.time() - t0)

    def scheduled(self, step: int) -> bool:
        return step in self._jobs

    def take(self, step: int) -> tuple[Collected, float]:
        """The batch of `step` and the seconds waited for it; the worker's error, if it failed."""
        t0 = time.time()
        collected = self._jobs.pop(step).result()
        return collected, time.time() - t0

    def drain(self) -> list[Collected]:
        """Wait until every scheduled batch is collected; those not yet taken, in step order."""
        return [self._jobs[s].result() for s in sorted(self._jobs)]

    def restore(self, collected: list[Collected]) -> None:
        """Batches a checkpoint stored, as if just collected."""
        for c in collected:
            done: Future = Future()
            done.set_result(c)
            self._jobs[c.step] = done

    def close(self) -> None:
        for job in self._jobs.values():
            job.cancel()
        self._worker.shutdown(wait=True)


# -- checkpoint ---------------------------------------------------------------------------------
def save_pending(ckpt_dir: Path, collected: list[Collected]) -> None:
    """Each batch collected and not yet trained, as arrays with its bookkeeping beside them."""
    for c in collected:
        meta = {"uids": json.dumps(c.batch.uids), "group_ids": json.dumps(c.batch.group_ids),
                "collected": json.dumps({"step": c.step, "version": c.version, "seconds": c.seconds,
                                         "roll": asdict(c.roll)})}
        arrays = {k: v.contiguous() for k, v in c.batch.arrays.items()}
        save_file(arrays, str(Path(ckpt_dir) / f"{PENDING_PREFIX}{c.step:07d}.safetensors"), metadata=meta)


def load_pending(ckpt_dir: Path, expected: range) -> list[Collected]:
    """The batches `save_pending` stored; they must be exactly those of the steps in `expected`."""
    from safetensors import safe_open

    out = []
    for path in sorted(Path(ckpt_dir).glob(f"{PENDING_PREFIX}*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            arrays: dict[str, torch.Tensor] = load_file(str(path))
            info = json.loads(meta["collected"])
            batch = TrajectoryBatch(arrays, json.loads(meta["uids"]), json.loads(meta["group_ids"]))
        except Exception as err:  # noqa: BLE001 - any damage: one clear message naming the file
            raise UserError(f"{path}: not a readable pending batch ({type(err).__name__}: {err})") from None
        out.append(Collected(info["step"], batch, RolloutStats.from_dict(info["roll"]), info["version"], info["seconds"]))
    steps = [c.step for c in out]
    if steps != list(expected):
        raise UserError(f"{ckpt_dir}: holds the collected batches of steps {steps}, but an asynchronous run "
                        f"resuming there needs those of steps {list(expected)} (rl.async_lag changed?)")
    return out
