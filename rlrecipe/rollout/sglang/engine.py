"""The SGLang rollout engine: a client of SGLang's native HTTP API (`sglang/api.py`) on many servers.

It is three parts, each readable and testable alone:

- `ServerFleet` (`sglang/fleet.py`): the servers, launched (`sglang/server.py`) or attached
  (`rollout.urls`), the router in front of them, which are live, recovery after a failure, and
  one request to one server;
- `GenerationClient` (`sglang/generation.py`): /generate calls (`sglang/call.py`), with read
  timeouts sized from the plan;
- `WeightPusher` (`sglang/weights.py`): weight pushes over disk, broadcast or tensor requests, each verified;
- for a colocated layout, `release_memory` / `resume_memory` (`sglang/memory.py`);
- under trainer.lora, `update_adapter`: the base stays, each push is an adapter (`sglang/lora.py`),
  and a colocated release frees the KV cache alone (the base weights stay where they are).

Each response's `meta_info.weight_version` is checked against the version this engine set, so a
token is never labelled with a policy version that did not produce it.

C3PO++: with `token_budget`, a call stops once the trajectories finished during it hold that
many response tokens; the requests in flight come back partial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from rlrecipe.recipe.schema import Recipe
from rlrecipe.recipe.systems import LoraSection, SGLangServer
from rlrecipe.rollout.base import Refill, RolloutEngine
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.generation import GenerationClient
from rlrecipe.rollout.sglang.lora import launch_args
from rlrecipe.rollout.sglang.memory import ALL_TAGS, RELEASE, RESUME, check_tags, flush, occupy
from rlrecipe.rollout.sglang.server import ServerProcess, model_arg, trainer_gpus_on_node
from rlrecipe.rollout.sglang.weights import WeightPusher
from rlrecipe.trajectory.record import SamplingParams, Trajectory


def _attr(part: str, name: str, doc: str) -> property:
    """An attribute of one of the engine's parts, read and written through the engine."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class SGLangEngine(RolloutEngine):
    """Rollouts on SGLang servers; every token keeps the server's log-prob and this engine's version."""

    urls = _attr("fleet", "urls", "the servers' URLs")
    servers = _attr("fleet", "servers", "the server processes this engine launched")
    router = _attr("fleet", "router", "sglang-router in front of the servers, if any")
    live = _attr("fleet", "live", "the servers still in use")
    cfg = _attr("fleet", "cfg", "rollout.sglang")
    version = _attr("fleet", "version", "the policy version new tokens are labelled with")
    max_concurrency = _attr("gen", "max_concurrency", "requests open per server at most")
    kv_tokens = _attr("gen", "kv_tokens", "tokens one server's KV cache holds (from the plan)")
    transport = _attr("weights", "transport", "how weights reach the servers")
    served_dtype = _attr("weights", "served_dtype", "the dtype the servers hold weights in")
    no_weight_check = _attr("weights", "no_weight_check", "servers whose weights cannot be fingerprinted")
    weight_check_s = _attr("weights", "weight_check_s", "seconds the last verification took")

    def __init__(self, urls: Sequence[str], *, eos_token_id: int | None = None, version: int = 0,
                 max_concurrency: int = 512, servers: Sequence[ServerProcess] | None = None,
                 stop_token_ids: Sequence[int] | None = None, cfg: SGLangServer | None = None,
                 router: ServerProcess | None = None, served_dtype: str | None = None,
                 fleet: ServerFleet | None = None, lora: bool = False):
        self.fleet = fleet or ServerFleet(urls, cfg=cfg, max_concurrency=max_concurrency, servers=servers,
                                          router=router)
        self.fleet.version = version
        self.eos = eos_token_id
        stop = list(stop_token_ids) if stop_token_ids is not None else (
            [eos_token_id] if eos_token_id is not None else [])
        self.gen = GenerationClient(self.fleet, stop_token_ids=stop, max_concurrency=max_concurrency)
        self.weights = WeightPusher(self.fleet, self.fleet.cfg, served_dtype, lora)
        self.lora = lora  # trainer.lora: pushes are adapters, and the base weights are never released
        self.released: set[str] = set()  # memory tags released and not resumed since
        self._closed = False

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe: Recipe, model_dir: str | Path, tokenizer, version: int = 0,
                    run_dir: Path | None = None, beside_training: bool = False) -> SGLangEngine:
        """Attach to rollout.urls, or launch the servers on this node; `beside_training`: this node's
        first trainer.nproc GPUs train, so launched servers take the GPUs after them."""
        ro = recipe.rollout
        eos = tokenizer.eos_token_id
        lora = recipe.trainer.lora.enabled
        if ro.urls:
            fleet = ServerFleet.attach(ro, run_dir)
            engine = cls(fleet.urls, eos_token_id=eos, version=version, max_concurrency=ro.sglang.max_concurrency,
                         served_dtype=ro.dtype, fleet=fleet, lora=lora)
        else:
            trainer_gpus = trainer_gpus_on_node(recipe.trainer) if beside_training else 0
            engine = cls.launch(model_dir, cfg=ro.sglang, dtype=ro.dtype, run_dir=run_dir, eos_token_id=eos,
                                version=version, seed=recipe.run.seed, trainer_gpus=trainer_gpus,
                                memory_saver=ro.colocate, kv_cache_dtype=ro.kv_cache_dtype,
                                lora=recipe.trainer.lora if lora else None)
        try:
            if ro.urls:
                engine.weights.ensure_model(model_dir, version)
            # a server started from another checkpoint answers /model_info with the right path too
            engine.verify_export(model_dir, version, when=f"at start, where it should serve {model_arg(model_dir)}")
        except BaseException:
            engine.close()
            raise
        engine.gen.size_queue_allowance(recipe, model_dir)
        return engine

    @classmethod
    def launch(cls, model_dir: str | Path, *, cfg: SGLangServer | None = None, dtype: str = "bfloat16",
               run_dir: str | Path | None = None, eos_token_id: int | None = None, version: int = 0, seed: int = 0,
               launch_cmd: Sequence[str] | Callable[[int, int], list[str]] | None = None,
               env: dict[str, str] | None = None, trainer_gpus: int = 0, memory_saver: bool = False,
               kv_cache_dtype: str = "auto", lora: LoraSection | None = None) -> SGLangEngine:
        """Start `cfg.num_servers` servers (see `launch_servers`) and, with `cfg.router`, the router in
        front of them; wait until they generate; return the engine. `lora` (trainer.lora, enabled):
        the servers take adapters, and the pushes are adapters."""
        cfg = cfg or SGLangServer()
        fleet = ServerFleet.launch(model_dir, cfg, dtype=dtype, run_dir=run_dir, seed=seed, launch_cmd=launch_cmd,
                                   env=env, trainer_gpus=trainer_gpus, memory_saver=memory_saver,
                                   kv_cache_dtype=kv_cache_dtype, lora_args=launch_args(lora))
        return cls(fleet.urls, eos_token_id=eos_token_id, version=version, max_concurrency=cfg.max_concurrency,
                   served_dtype=dtype, fleet=fleet, lora=lora is not None and lora.enabled)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None,
                 refill: Refill | None = None) -> list[Trajectory]:
        # `seed` is not sent: SGLang draws from its own --random-seed stream.
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        return self.gen.generate(trajs, params, token_budget, refill)

    # -- servers ---------------------------------------------------------------------------------
    def model_info(self, i: int = 0) -> dict:
        return self.fleet.model_info(i)

    def fleet_metrics(self) -> dict[str, float]:
        return {**self.fleet.metrics(), "weight_check_s": self.weights.weight_check_s}

    # -- weights ---------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_dir: str | Path, version: int, verify: bool = True) -> None:
        self.weights.update_from_disk(model_dir, version, verify)

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        self.weights.update_from_state(state_dict, version)

    def update_weights_from_tensor(self, state_dict: dict, version: int, verify: bool = True) -> None:
        self.weights.update_from_tensor(state_dict, version, verify)

    def update_adapter(self, adapter, version: int, verify: bool = True) -> None:
        """trainer.lora: the adapter (weights/adapter.py) of `version` into every live server, named by
        every /generate from now on; the previous one unloaded."""
        self.weights.update_adapter(adapter, version, verify)

    def handles_pushed(self, version: int, world_size: int):
        """A push by handles, bucket by bucket (weights/handle_push.py); verified by `verify_push`."""
        return self.weights.handles_pushed(version, world_size)

    def verify_export(self, model_dir: str | Path, version: int, when: str | None = None) -> None:
        self.weights.verify_export(model_dir, version, when)

    # -- memory (rollout.colocate) ---------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Every live server frees the memory of `tags` (sglang/memory.py; default all, and under
        trainer.lora all but the base weights, which no push rewrites) while the trainer trains;
        refused while this engine has requests in flight (SGLang would die of them)."""
        tags = check_tags(tags if tags is not None else [t for t in ALL_TAGS if not (self.lora and t == "weights")])
        calls, posts = self.gen.calls, self.fleet.http.open_requests()
        if calls or posts:
            raise RuntimeError(f"release_memory: {calls} generate call(s) and {posts} request(s) still in flight; "
                               "SGLang asserts it is idle at a release and dies otherwise, so generation must "
                               "finish (or be aborted and answered) first")
        occupy(self.fleet, RELEASE, tags)
        self.released |= set(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Every live server allocates the memory of `tags` again. Weights resumed hold garbage until
        the next push lands: resume ["weights"], push, then resume ["kv_cache"] (and "cuda_graph").
        Under trainer.lora a tag not released is left out (SGLang dies resuming one)."""
        tags = check_tags(tags)
        if self.lora:
            tags = [t for t in tags if t in self.released]
            if not tags:
                return
        occupy(self.fleet, RESUME, tags)
        self.released -= set(tags)

    def flush_cache(self) -> None:
        """Every live server drops its prefix cache (SGLang answers 200 when it flushed, 400 while
        requests run)."""
        flush(self.fleet)

    def verify_push(self, version: int, *, state_dict: dict | None = None,
                    model_dir: str | Path | None = None, adapter=None) -> None:
        """The check of a push made with `verify=False`: every live server holds `state_dict` (or the
        export `model_dir`, or serves the `adapter` pushed) as `version`."""
        if adapter is not None:
            self.weights.verify_adapter(version)
        elif state_dict is not None:
            self.weights.verify(version, state=state_dict)
        elif model_dir is not None:
            self.weights.verify_export(model_dir, version)
        else:
            raise ValueError("verify_push takes one of state_dict or model_dir")

    def expect_logprobs(self, scores) -> None:
        self.weights.expect(scores)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fleet.recovery.close()  # no restart starts while the broadcast group is left
        self.weights.close()
        self.fleet.close()
