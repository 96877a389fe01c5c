"""The rollout engine interface shared by the in-process and SGLang engines."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

from rlrecipe.trajectory.record import SamplingParams, Trajectory

# `generate(..., refill=f)`: f(k) is called after k trajectories finished in the call (none once the
# budget is reached) and returns new trajectories to start in the same call, possibly none.
Refill = Callable[[int], list[Trajectory]]

# `Trajectory.meta[SEED_KEY]`: the trajectory's own sampling seed. Engines that honour it draw each
# token from a stream fixed by (that seed, the token's position), so a sample does not depend on
# which other trajectories shared its batch, or on where an interrupted run stopped.
SEED_KEY = "seed"

# What a colocated engine gives up while the trainer trains, in SGLang's names (the in-process
# engine keeps no CUDA graphs, so releasing "cuda_graph" frees nothing there).
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class RolloutEngine(ABC):
    """Samples responses; reports the log-prob of every sampled token under its own numerics."""

    version: int = 0

    @abstractmethod
    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None,
                 refill: Refill | None = None) -> list[Trajectory]:
        """Continue every trajectory (fresh ones have empty responses) until eos or max_new_tokens.

        With `token_budget`, stop as soon as the trajectories that finished during this call hold
        at least that many response tokens; the others come back with status RUNNING and what
        they have so far, and a later call resumes them (tokens then carry the new version).
        With `refill` (see `Refill`), trajectories it returns join the call as others finish;
        the caller keeps them (they are not in the returned list) and they count toward the budget.
        Trajectories are updated in place and returned in the same order.
        """

    @abstractmethod
    def update_weights_from_disk(self, model_dir: str | Path, version: int, verify: bool = True) -> None:
        """Load new weights (an HF export) and set the policy version for new tokens; `verify` False:
        the check is left to `verify_push`."""

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        """Faster path where the engine shares memory with the trainer; default: not supported."""
        raise NotImplementedError

    # -- colocated layouts (rollout.colocate): the GPU handed to the trainer between rollouts -------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Discard the KV cache and the weights (`tags`) while the trainer trains; nothing may be in flight."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory (rollout.colocate)")

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Allocate `tags` again. Resumed weights are garbage until the next push lands."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume its memory (rollout.colocate)")

    def flush_cache(self) -> None:  # noqa: B027 - optional hook, no prefix cache by default
        """Drop cached prefixes (computed under the weights before the push)."""

    def verify_push(self, version: int, *, state_dict: dict | None = None,  # noqa: B027 - optional hook
                    model_dir: str | Path | None = None) -> None:
        """Check a push made with its verification deferred (a colocated step verifies once the KV
        cache is back): the engine must hold `state_dict` or the export `model_dir` as `version`."""

    def expect_logprobs(self, scores) -> None:  # noqa: B027 - optional hook
        """The trainer's log-probs of a fixed probe under the weights of `scores.version`, which the
        engine may check its servers against (rollout/weights/probe.py); ignored by default."""

    def fleet_metrics(self) -> dict[str, float]:
        """What a step logs of the engine's servers (none by default: one process, nothing to lose)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release servers or memory."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
