"""Generation on an SGLang fleet: read timeouts sized from the plan, and each call's requests.

Every /generate goes through one asyncio thread (`sglang/http_pool.py`), at most `max_concurrency` open
per server; a group's samples go to one server, which then shares their prompt's prefix cache.
`max_new_tokens` is capped to the room left in the server's context, and a trajectory with no
room left is truncated without a request. One call's requests, their resends and their aborts
are `sglang/call.py`'s.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from pathlib import Path

from rlrecipe.core.console import console
from rlrecipe.recipe.schema import Recipe
from rlrecipe.rollout.base import Refill
from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.rollout.sglang.call import GenerateCall
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.trajectory.record import SamplingParams, Trajectory


class GenerationClient:
    """Sends a fleet its /generate requests; how long each may go without an answer."""

    def __init__(self, fleet: ServerFleet, *, stop_token_ids: Sequence[int], max_concurrency: int):
        self.fleet = fleet
        self.stop_token_ids = list(stop_token_ids)
        self.max_concurrency = max_concurrency
        # tokens one server's KV cache holds and the longest prompt, from the plan (size_queue_allowance);
        # None: unknown, and the read timeout allows one turn (see read_timeout)
        self.kv_tokens: int | None = None
        self.prompt_tokens = 0
        self.calls = 0  # generate calls running now (a colocated release must wait for none)
        self._calls_lock = threading.Lock()

    def generate(self, trajs: list[Trajectory], params: SamplingParams, token_budget: int | None,
                 refill: Refill | None) -> list[Trajectory]:
        self.fleet.check_alive()
        todo = admit(trajs, params)
        if todo:
            with self._calls_lock:
                self.calls += 1
            try:
                GenerateCall(self.fleet, params, TokenBudget(token_budget), refill,
                             stop_token_ids=self.stop_token_ids, read_timeout=self.read_timeout).run(todo)
            finally:
                with self._calls_lock:
                    self.calls -= 1
        return trajs

    def read_timeout(self, max_new_tokens: int) -> float:
        """Seconds a /generate for this many new tokens may go without an answer. The clock runs from
        when the request is sent, so it counts queueing too: where the plan says a server's KV cache
        holds fewer full-length sequences than the engine keeps open on it (kv_tokens, set from the
        recipe), the per-token allowance is given once per turn a request may have to wait."""
        cfg = self.fleet.cfg
        return (cfg.request_timeout_s
                + cfg.request_timeout_per_token_s * max_new_tokens * self.queue_turns(max_new_tokens))

    def queue_turns(self, max_new_tokens: int) -> int:
        """Turns of full-length sequences the requests open on one server take through its KV cache
        (1 when it holds them all, or when the plan's KV cache size is not known)."""
        if not self.kv_tokens:
            return 1
        fit = max(1, self.kv_tokens // (self.prompt_tokens + max_new_tokens))
        return max(1, math.ceil(self.max_concurrency / fit))

    def size_queue_allowance(self, recipe: Recipe, model_dir: str | Path) -> None:
        """Size the read timeout's queueing allowance from the KV cache `rlrecipe plan` gives each
        server (rlrecipe/checks/plan.py) and say what it comes to for the recipe's longest request."""
        config = Path(model_dir) / "config.json"
        if not config.is_file():
            return
        from rlrecipe.checks.model_dims import ModelDims
        from rlrecipe.checks.plan import sglang_memory

        _, _, kv, kv_token = sglang_memory(recipe, ModelDims.from_config(json.loads(config.read_text())))
        self.kv_tokens, self.prompt_tokens = int(kv // kv_token), recipe.data.max_prompt_tokens
        longest = max(recipe.rollout.max_new_tokens, recipe.eval.max_new_tokens)
        turns = self.queue_turns(longest)
        if turns > 1:
            console.print(f"SGLang: each server's KV cache holds {self.kv_tokens // (self.prompt_tokens + longest)} "
                          f"sequences of {self.prompt_tokens + longest} tokens (rlrecipe plan) and up to "
                          f"{self.max_concurrency} requests are open on it: a request of {longest} new tokens may wait "
                          f"{turns} turns, so it may go {self.read_timeout(longest):.0f} s without an answer before "
                          "its server counts as hung", highlight=False, soft_wrap=True)
