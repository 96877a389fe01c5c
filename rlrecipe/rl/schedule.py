"""Where each step's batch comes from and when the rollout engine gets new weights.

Synchronous (`rl.async_lag: 0`): the batch is collected at the start of its step, and the trained
weights are pushed after every `rollout.weight_update_every`-th step. Asynchronous (`async_lag` = L):
batches are collected on a worker thread L steps ahead (rollout_ahead.py), each under the weights
its schedule names. Either way every rank calls the same methods: gathering a sharded trainer's
weights is collective, while only rank 0 holds the engine, the pool and the worker.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.core.dist import broadcast_from_rank_zero, is_rank_zero, world_size
from rlrecipe.core.seeds import ROLLOUT_STEP, mix_seed
from rlrecipe.recipe.schema import Recipe
from rlrecipe.rl.ahead import RolloutAhead, load_pending, save_pending, weights_version
from rlrecipe.rl.colocate import TakingTurns
from rlrecipe.rl.rollout_stats import RolloutStats
from rlrecipe.rollout.weights.adapter import Adapter
from rlrecipe.rollout.weights.handle_push import push_by_handles
from rlrecipe.rollout.weights.handles import HostMirror
from rlrecipe.rollout.weights.probe import Scores, probe_sequences
from rlrecipe.rollout.weights.transport import WeightTransport, for_lora
from rlrecipe.train.base import TrainSample
from rlrecipe.trajectory.arrays import broadcast_batch_from_rank_zero

ROLLOUT_EXPORTS = "weights_for_rollout"


def step_seed(run_seed: int, step: int) -> int:
    """The sampling seed of a step's rollout: a function of the run's seed and the step alone."""
    return mix_seed(run_seed, step, ROLLOUT_STEP)


class WeightsOut:
    """The trainer's weights on their way to the rollout engine, by the run's transport."""

    def __init__(self, trainer, run, tokenizer, transport: WeightTransport, version: int, *,
                 bucket_bytes: int, turns: TakingTurns | None = None):
        """`version`: the trainer's now; `bucket_bytes`: the most one push request carries (by handle:
        every rank's buffer); `turns`: a colocated layout's hand-overs, which each push goes through.
        The engine is attached after (`attach`): colocated, it starts once the trainer has left the
        GPU, and the probe is scored before that. A LoRA trainer's pushes are its adapter, whatever
        transport the caller decided without trainer.lora (`for_lora`)."""
        if getattr(trainer, "is_lora", False):
            transport = for_lora(transport)
        self.trainer, self.engine, self.run, self.tokenizer, self.transport = trainer, None, run, tokenizer, transport
        self.turns = turns if turns is not None and turns.enabled else None
        self.bucket_bytes = bucket_bytes
        self.mirror = HostMirror() if transport is WeightTransport.IPC and is_rank_zero() else None
        # servers are checked against the trainer's log-probs of a fixed probe where no exact check
        # reaches them (rollout/weights/probe.py): scored now for the weights they start with
        self.probe = probe_sequences(tokenizer) if transport is not WeightTransport.IN_MEMORY else None
        self._scores = self._score(version)

    def attach(self, engine) -> None:
        """The rollout engine (None on ranks other than 0), told what its starting weights must give."""
        self.engine = engine
        if engine is not None and self._scores is not None:
            engine.expect_logprobs(self._scores)

    def _expect(self, version: int) -> None:
        """The probe scored under the trainer's weights now (collective), handed to the engine as
        what `version` must give."""
        scores = self._score(version)
        if self.engine is not None and scores is not None:
            self.engine.expect_logprobs(scores)

    def _score(self, version: int) -> Scores | None:
        if not self.probe:
            return None
        # SGLang's input_token_logprobs come from the raw logits whatever the request's temperature
        # (its logprob processor tempers the sampled tokens' only): the probe is scored at temperature 1
        sampling_temperature = self.trainer.temperature
        self.trainer.temperature = 1.0
        try:
            logp = [lp.tolist() for lp, _ in self.trainer.compute_logprobs([TrainSample(s, 1) for s in self.probe])]
        finally:
            self.trainer.temperature = sampling_temperature
        return Scores(version, self.probe, logp)

    @property
    def exports(self) -> Path:
        return Path(self.run.dir) / ROLLOUT_EXPORTS

    def push(self, version: int) -> None:
        """Into the engine now (collective; rank 0 pushes): in memory, by broadcast, by pickled
        tensors, by every rank's handles, by an HF export the servers load, or (trainer.lora on
        SGLang) the adapter alone; colocated, through the engine's release."""
        if self.turns is not None:
            self.turns.push(version, lambda: self._expect(version), lambda verify: self._send(version, verify))
        else:
            self._expect(version)
            self._send(version, verify=True)

    def _send(self, version: int, verify: bool) -> dict:
        """Push by the transport; `verify` False leaves the check to `engine.verify_push` with what
        this returns."""
        if self.transport.is_lora:
            adapter = self._adapter(version)
            if self.engine is not None:
                self.engine.update_adapter(adapter, version, verify=verify)
                self._drop_adapters_before(version)
            return {"adapter": adapter}
        if self.transport is WeightTransport.DISK:
            export = self.trainer.export_hf(self.exports, self.tokenizer)
            if self.engine is not None:
                self.engine.update_weights_from_disk(export, version, **({} if verify else {"verify": False}))
            return {"model_dir": export}
        if self.transport is WeightTransport.IPC:
            state = self._send_handles(version)
            if self.engine is not None and verify:
                self.engine.verify_push(version, state_dict=state)
            return {"state_dict": state}
        state = self.trainer.rollout_state()
        if self.engine is not None:
            if self.transport is WeightTransport.TENSOR:
                self.engine.update_weights_from_tensor(state, version, verify=verify)
            else:
                self.engine.update_weights_from_state(state, version)
        return {"state_dict": state}

    def _adapter(self, version: int) -> Adapter | None:
        """The trainer's adapter now (collective: every rank calls adapter_state(), rank 0 gets it
        whole); weight_sync disk: written by rank 0 as a PEFT directory of its own per version."""
        config, tensors = self.trainer.adapter_state()
        if not is_rank_zero():
            return None
        adapter = Adapter(config, tensors)
        if self.transport is WeightTransport.LORA_DISK:
            adapter = adapter.write(self.exports / f"adapter-v{version:07d}")
        return adapter

    def _drop_adapters_before(self, version: int) -> None:
        """The PEFT directories of earlier pushes, no longer served (SGLang read them at their load)."""
        for old in self.exports.glob("adapter-v*") if self.exports.is_dir() else []:
            if old.name < f"adapter-v{version:07d}":
                shutil.rmtree(old, ignore_errors=True)

    def _send_handles(self, version: int) -> dict:
        """Every rank shares its copy of the weights by handle, bucket by bucket; rank 0 posts them and
        keeps what it pushed, to verify (collective)."""
        sends: list = []

        def open_sessions() -> None:
            if self.engine is not None:
                sends.append(stack.enter_context(self.engine.handles_pushed(version, world_size())))

        with ExitStack() as stack:
            broadcast_from_rank_zero(open_sessions)  # a server refusing the session fails every rank at once
            return push_by_handles(self.trainer.full_weights(), self.bucket_bytes, sends[0] if sends else None,
                                   self.mirror)

    def freeze(self, version: int):
        """A copy of the weights now, for the worker to install later (collective): cloned tensors
        in memory, or an export of its own on disk. None on ranks without the engine."""
        self._expect(version)
        if self.transport.is_lora:  # small: held in memory, or its own directory on disk
            adapter = self._adapter(version)
            return adapter.frozen() if adapter is not None and self.engine is not None else None
        if self.transport is WeightTransport.DISK:
            export = self.trainer.export_hf(self.exports / f"v{version:07d}", self.tokenizer)
            return export if self.engine is not None else None
        if self.transport is not WeightTransport.IN_MEMORY:
            raise ValueError(f"weights cannot be held for later over {self.transport.name.lower()}")
        state = self.trainer.rollout_state()
        return {k: v.detach().clone() for k, v in state.items()} if self.engine is not None else None

    def install(self, frozen, version: int) -> None:
        """On the worker: what `freeze` kept, into the engine; older exports are deleted."""
        if isinstance(frozen, Adapter):
            self.engine.update_adapter(frozen, version)
            self._drop_adapters_before(version)
        elif isinstance(frozen, Path):
            self.engine.update_weights_from_disk(frozen, version)
            for old in frozen.parent.glob("v*"):
                if old.name < frozen.name:
                    shutil.rmtree(old, ignore_errors=True)
        else:
            self.engine.update_weights_from_state(frozen, version)


@dataclass
class Taken:
    """What every rank learns of a batch collected ahead, beside its arrays."""

    roll: RolloutStats
    version: int  # the weights that collected it
    collect_s: float  # the worker's time collecting and grading it
    wait_s: float  # the trainer's wait for it


class StepRollout:
    """Each step's graded batch, and the engine's weights kept to the schedule."""

    def __init__(self, recipe: Recipe, collect: Callable, weights: WeightsOut, start: int,
                 resumed_from: Path | None = None):
        """`resumed_from`: the checkpoint a resumed run starts from, holding the batches collected ahead
        of `start` (`save`)."""
        self.lag, self.every, self.steps = recipe.rl.async_lag, recipe.rollout.weight_update_every, recipe.rl.steps
        self.seed, self.weights = recipe.run.seed, weights
        self._collect = collect
        self._timing: dict[str, float] = {}  # the last asynchronous batch's, for `timing`
        self.ahead = None
        if start == 0 and recipe.rollout.urls and weights.transport is WeightTransport.DISK:
            # attached servers, perhaps on other nodes, load every push from run.dir: loading the
            # starting weights from there now finds one that cannot see it before a step's rollouts
            weights.push(0)
        if not self.lag:
            if start:  # a resumed run: the engine starts from the stage's first weights
                weights.push(start)
            return
        if is_rank_zero():
            self.ahead = RolloutAhead(self._collect_step, weights.install, lambda: weights.engine.version)
            if resumed_from is not None:
                self.ahead.restore(load_pending(resumed_from, range(start, min(start + self.lag, self.steps))))
            for step in range(start, min(start + self.lag, self.steps)):
                if not self.ahead.scheduled(step):  # a fresh run: under the starting weights
                    self.ahead.schedule(step)

    def _collect_step(self, step: int):
        return self._collect(seed=step_seed(self.seed, step))

    def batch_for(self, step: int):
        """The graded batch that trains at `step` (every rank), and its rollout statistics."""
        if not self.lag:
            return broadcast_batch_from_rank_zero(lambda: self._collect_step(step))

        def taken():
            collected, waited = self.ahead.take(step)
            return collected.batch, Taken(collected.roll, collected.version, collected.seconds, waited)

        batch, got = broadcast_batch_from_rank_zero(taken)
        self._timing = {"rollout_version": float(got.version), "rollout_lag": float(step - got.version),
                        "rollout_collect_s": got.collect_s, "rollout_wait_s": got.wait_s}
        self._schedule_next(step)
        return batch, got.roll

    def _schedule_next(self, step: int) -> None:
        """The batch of step + L, under the weights of `step` (the trainer's now)."""
        later = step + self.lag
        if later >= self.steps:
            return
        version = weights_version(later, self.lag)  # = step
        fresh = version > 0  # the engine holds the starting weights only at step 0 of a fresh run
        if self.lag == 1:  # the worker is idle: push as a synchronous run would
            if fresh:
                self.weights.push(version)
            if self.ahead is not None:
                self.ahead.schedule(later)
            return
        frozen = self.weights.freeze(version) if fresh else None
        if self.ahead is not None:
            self.ahead.schedule(later, frozen, version if fresh else None)

    def trained(self, version: int) -> None:
        """After the update that made `version`: a synchronous run pushes it when due."""
        if not self.lag and version % self.every == 0:
            self.weights.push(version)

    def timing(self, rollout_s: float, generated_tokens: int) -> dict[str, float]:
        """The step's rollout timing: synchronous, rollout_s is the collection; asynchronous, it is
        the wait for a batch collected while earlier steps trained, and the overlap is the rest."""
        if not self.lag:
            return {"gen_tokens_per_s": generated_tokens / max(rollout_s, 1e-9)}
        t = self._timing
        return {"gen_tokens_per_s": generated_tokens / max(t["rollout_collect_s"], 1e-9), **t,
                "overlap_s": max(0.0, t["rollout_collect_s"] - t["rollout_wait_s"])}

    def hold_current_weights(self, version: int) -> None:
        """Before validation: the worker idle and the engine holding the trainer's weights."""
        if self.ahead is not None:
            self.ahead.drain()
        if self.lag:
            self.weights.push(version)

    def save(self, ckpt_dir: Path) -> None:
        """Into a checkpoint (rank 0): the batches collected and not yet trained, once the worker is idle."""
        save_pending(ckpt_dir, self.ahead.drain() if self.ahead is not None else [])

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
