"""Rollout and training taking turns on the same GPUs (rollout.colocate).

Each step, after the rollout: the engine releases its KV cache and weights (nothing in flight), the
trainer reloads its state, updates, and offloads its optimizer state; then the engine allocates
weights again (garbage until the push), the weights are pushed with their check deferred, the trainer
offloads its weights too, the engine flushes its prefix cache and allocates its KV cache again, and
only then is the push verified (a check by probe generates). Trainer calls run on every rank; engine
calls on rank 0, which alone holds the engine. Every hand-over is timed: `seconds()` are the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from rlrecipe.rl.step_timer import StepTimer

PHASES = ("release_s", "reload_s", "update_s", "offload_s", "resume_s", "push_s", "verify_s")


class TakingTurns:
    def __init__(self, trainer, enabled: bool):
        """Not `enabled`: every method does nothing. The engine comes later (`attach`): it starts
        once the trainer has left the GPU."""
        self.trainer, self.engine, self.enabled = trainer, None, enabled
        self.released = False  # the engine gave the GPU to the trainer and has not had its push (every rank)
        self.phase = StepTimer()  # `with self.phase("push_s"): ...`

    def attach(self, engine) -> None:
        """The rollout engine (None on ranks other than 0)."""
        self.engine = engine

    def seconds(self) -> dict[str, float]:
        """The hand-overs' seconds since the last call, as metrics (none when not colocated)."""
        out = {f"colocate/{k}": self.phase.seconds.get(k, 0.0) for k in PHASES} if self.enabled else {}
        self.phase = StepTimer()
        return out

    def before_rollout_starts(self) -> None:
        """The trainer, just built (or resumed), leaves the GPU to the engine about to start."""
        if self.enabled:
            with self.phase("offload_s"):
                self.trainer.offload_states("optimizer")
                self.trainer.offload_states("weights")

    @contextmanager
    def training(self):
        """Around the update (or a checkpoint's save): the engine releases the GPU and the trainer
        reloads before it; the optimizer's state goes back to host memory after it."""
        if not self.enabled:
            yield
            return
        if self.engine is not None:
            with self.phase("release_s"):
                self.engine.release_memory()
        self.released = True
        with self.phase("reload_s"):
            self.trainer.reload_states()
        with self.phase("update_s"):
            yield
        with self.phase("offload_s"):
            self.trainer.offload_states("optimizer")

    def trainer_back(self) -> None:
        """The run is over and the engine closed: the trainer's state back for the final export."""
        if self.enabled:
            self.trainer.reload_states()

    def push(self, version: int, expect: Callable[[], None], send: Callable[[bool], dict]) -> None:
        """The new weights into the released engine: `expect()` scores the probe under the trainer's
        weights, `send(verify)` pushes them and returns what it pushed (`state_dict` or `model_dir`),
        for the check made once the KV cache is back. An engine that holds its memory (a resumed
        run's first push) is first released, as before an update."""
        if not self.released:
            with self.training():
                pass
        expect()
        engine = self.engine
        if engine is not None:
            with self.phase("resume_s"):
                engine.resume_memory(["weights"])
        with self.phase("push_s"):
            sent = send(False)
        with self.phase("offload_s"):
            self.trainer.offload_states("weights")
        if engine is not None:
            with self.phase("resume_s"):
                engine.flush_cache()
                engine.resume_memory(["kv_cache", "cuda_graph"])
            with self.phase("verify_s"):
                engine.verify_push(version, **sent)
        self.released = False
