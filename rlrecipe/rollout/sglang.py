"""The SGLang rollout engine: a client of SGLang's native HTTP API (`sglang_api.py`) on many servers.

It launches the servers itself (`sglang_server.py`) or attaches to running ones (`rollout.urls`),
and keeps every token's log-prob and policy version. Every /generate goes through one asyncio
thread (`http_pool.py`), at most `max_concurrency` open per server; a group's samples go to one
server, which then shares their prompt's prefix cache. A server that dies or stays silent past
its read timeout stops the call with an error naming it, or (retry_on_other_servers) its
requests go to the others and it is left out until it answers again (`server_recovery.py`: with
`max_restarts` a launched one is started again; any one answering again is taken back at the next
weight update). With `rollout.sglang.router`, every
/generate goes to sglang-router in front of the servers instead (one URL, which balances them);
weight updates, aborts and server info still go to each server, since the router forwards none
of them.

Each response's `meta_info.weight_version` is checked against the version this engine set, so a
token is never labelled with a policy version that did not produce it. `max_new_tokens` is capped
to the room left in the server's context, and a trajectory with no room left is truncated
without a request.

C3PO++: with `token_budget`, a call stops once the trajectories finished during it hold that
many response tokens; the requests in flight come back partial. One call's requests, their
resends and their aborts are `sglang_call.py`'s.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import Recipe
from rlrecipe.recipe.systems import RolloutSection, SGLangServer
from rlrecipe.rollout.api_key import auth_headers
from rlrecipe.rollout.base import Refill, RolloutEngine
from rlrecipe.rollout.c3po_budget import TokenBudget, admit
from rlrecipe.rollout.http_pool import HttpPool
from rlrecipe.rollout.server_recovery import ServerRecovery
from rlrecipe.rollout.sglang_api import apply_output, context_length
from rlrecipe.rollout.sglang_call import GenerateCall
from rlrecipe.rollout.sglang_server import (
    ServerProcess,
    launch_servers,
    model_arg,
    start_router,
    trainer_gpus_on_node,
    wait_until_healthy,
)
from rlrecipe.rollout.weight_transport import WeightTransport, weight_transport
from rlrecipe.trajectory.record import SamplingParams, Trajectory

if TYPE_CHECKING:
    from rlrecipe.rollout.weight_broadcast import WeightBroadcast


def _same_model(a: str | Path, b: str | Path) -> bool:
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")


class SGLangEngine(RolloutEngine):
    """Rollouts on SGLang servers; every token keeps the server's log-prob and this engine's version."""

    def __init__(self, urls: Sequence[str], *, eos_token_id: int | None = None, version: int = 0,
                 max_concurrency: int = 512, servers: Sequence[ServerProcess] | None = None,
                 stop_token_ids: Sequence[int] | None = None, cfg: SGLangServer | None = None,
                 router: ServerProcess | None = None, served_dtype: str | None = None):
        if not urls:
            raise UserError("rollout.urls: no SGLang server to talk to")
        self.urls = [u.rstrip("/") for u in urls]
        self.version = version
        self.eos = eos_token_id
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else (
            [eos_token_id] if eos_token_id is not None else [])
        self.max_concurrency = max_concurrency
        self.servers: list[ServerProcess] = list(servers or [])
        self.router = router  # sglang-router in front of the servers: every /generate goes to it
        self._gen_urls = [router.url] if router is not None else self.urls
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._sessions_lock = threading.Lock()
        # every /generate goes through one asyncio thread, at most max_concurrency open per server
        self._http = HttpPool(len(self._gen_urls), max_concurrency * (len(self.urls) if router else 1))
        self.cfg = cfg or SGLangServer()
        self.transport = weight_transport("sglang", self.cfg)
        self.live = list(range(len(self.urls)))  # servers still in use (retry_on_other_servers drops some)
        self._broadcast: WeightBroadcast | None = None  # weight_sync: distributed, made on first use
        self._failed: set[int] = set()  # servers that died or hung under this engine (until taken back)
        self._recovery = ServerRecovery(self.servers, self.cfg.max_restarts)
        self._server_infos: dict[int, dict] = {}
        self._weight_version: list[str | None] = [None] * len(self.urls)  # None: not set by this engine
        self._closed = False
        # the dtype the servers hold weights in (rollout.dtype; None: as sent): the fingerprint after
        # each push compares in it (weight_check.py); servers without /get_weights_by_name are skipped
        self.served_dtype = served_dtype
        # tokens one server's KV cache holds and the longest prompt, from the plan (from_recipe);
        # None: unknown, and the read timeout allows one turn (see read_timeout)
        self.kv_tokens: int | None = None
        self.prompt_tokens = 0
        self.no_weight_check: set[int] = set()
        self.weight_check_s = 0.0

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe: Recipe, model_dir: str | Path, tokenizer, version: int = 0,
                    run_dir: Path | None = None, beside_training: bool = False) -> SGLangEngine:
        """Attach to rollout.urls, or launch the servers on this node; `beside_training`: this node's
        first trainer.nproc GPUs train, so launched servers take the GPUs after them."""
        ro = recipe.rollout
        eos = tokenizer.eos_token_id
        if ro.urls:
            engine = cls._attach(ro, eos, version, run_dir)
        else:
            trainer_gpus = trainer_gpus_on_node(recipe.trainer) if beside_training else 0
            engine = cls.launch(model_dir, cfg=ro.sglang, dtype=ro.dtype, run_dir=run_dir, eos_token_id=eos,
                                version=version, seed=recipe.run.seed, trainer_gpus=trainer_gpus)
        try:
            if ro.urls:
                engine.ensure_model(model_dir, version)
            # a server started from another checkpoint answers /get_model_info with the right path too
            engine.verify_export(model_dir, version, when=f"at start, where it should serve {model_arg(model_dir)}")
        except BaseException:
            engine.close()
            raise
        engine.size_queue_allowance(recipe, model_dir)
        return engine

    @classmethod
    def _attach(cls, ro: RolloutSection, eos: int | None, version: int, run_dir: Path | None) -> SGLangEngine:
        """An engine over rollout.urls, with the router in front of them where asked."""
        urls = [u.rstrip("/") for u in ro.urls]
        # attached servers may still be starting (or restarting): the same bounded wait as launched ones
        wait_until_healthy([(u, None) for u in urls], ro.sglang.startup_timeout_s)
        router = start_router(urls, ro.sglang, run_dir) if ro.sglang.router else None
        try:
            return cls(urls, eos_token_id=eos, version=version, max_concurrency=ro.sglang.max_concurrency,
                       cfg=ro.sglang, router=router, served_dtype=ro.dtype)
        except BaseException:
            if router is not None:
                router.stop()
            raise

    def size_queue_allowance(self, recipe: Recipe, model_dir: str | Path) -> None:
        """Size the read timeout's queueing allowance from the KV cache `rlrecipe plan` gives each
        server (rlrecipe/checks/plan.py) and say what it comes to for the recipe's longest request."""
        config = Path(model_dir) / "config.json"
        if not config.is_file():
            return
        from rlrecipe.checks.plan import ModelDims, sglang_memory

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

    @classmethod
    def launch(cls, model_dir: str | Path, *, cfg: SGLangServer | None = None, dtype: str = "bfloat16",
               run_dir: str | Path | None = None, eos_token_id: int | None = None, version: int = 0, seed: int = 0,
               launch_cmd: Sequence[str] | Callable[[int, int], list[str]] | None = None,
               env: dict[str, str] | None = None, trainer_gpus: int = 0) -> SGLangEngine:
        """Start `cfg.num_servers` servers (see `launch_servers`) and, with `cfg.router`, the router in
        front of them; wait until they generate; return the engine."""
        cfg = cfg or SGLangServer()
        servers = launch_servers(model_dir, cfg, dtype=dtype, run_dir=run_dir, seed=seed, launch_cmd=launch_cmd,
                                 env=env, trainer_gpus=trainer_gpus)
        router = None
        try:
            wait_until_healthy([(s.url, s) for s in servers], cfg.startup_timeout_s)
            if cfg.router:
                router = start_router([s.url for s in servers], cfg, servers[0].log_path.parent, env)
            return cls([s.url for s in servers], eos_token_id=eos_token_id, version=version,
                       max_concurrency=cfg.max_concurrency, servers=servers, cfg=cfg, router=router, served_dtype=dtype)
        except BaseException:
            for s in [router, *servers]:
                if s is not None:
                    s.stop()
            raise

    # -- plumbing --------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(auth_headers())
            with self._sessions_lock:
                self._sessions.append(s)
        return s

    def _server(self, i: int) -> ServerProcess | None:
        return self.servers[i] if i < len(self.servers) else None

    def _check_alive(self) -> None:
        if self.router is not None and self.router.proc is not None and not self.router.alive():
            raise self.router.crash_error()
        for i, s in enumerate(self.servers):
            if i in self.live and s.proc is not None and not s.alive():
                self._leave_out(i, s.crash_error())

    def fleet_metrics(self) -> dict[str, float]:
        """Servers in use and the restarts spent so far: a run losing servers shows in its metrics."""
        spent = sum(self.cfg.max_restarts - left for left in self._recovery.restarts_left.values())
        return {"rollout_servers_live": float(len(self.live)), "rollout_server_restarts": float(spent),
                "weight_check_s": self.weight_check_s}

    def read_timeout(self, max_new_tokens: int) -> float:
        """Seconds a /generate for this many new tokens may go without an answer. The clock runs from
        when the request is sent, so it counts queueing too: where the plan says a server's KV cache
        holds fewer full-length sequences than the engine keeps open on it (kv_tokens, set from the
        recipe), the per-token allowance is given once per turn a request may have to wait."""
        return (self.cfg.request_timeout_s
                + self.cfg.request_timeout_per_token_s * max_new_tokens * self.queue_turns(max_new_tokens))

    def queue_turns(self, max_new_tokens: int) -> int:
        """Turns of full-length sequences the requests open on one server take through its KV cache
        (1 when it holds them all, or when the plan's KV cache size is not known)."""
        if not self.kv_tokens:
            return 1
        fit = max(1, self.kv_tokens // (self.prompt_tokens + max_new_tokens))
        return max(1, math.ceil(self.max_concurrency / fit))

    def _leave_out(self, i: int, error: UserError) -> None:
        """Server i died or hung: raise `error`, or with retry_on_other_servers, stop using it."""
        self._failed.add(i)  # nothing more is asked of it on the way out (aborts)
        if not self.cfg.retry_on_other_servers:
            raise error
        if i not in self.live:
            return  # left out already (its other requests fail the same way)
        self.live.remove(i)
        self._http.mark_down(i)
        if not self.live:
            raise UserError(f"{error}; no SGLang server left to retry on") from None
        console.print(f"[yellow]warning[/]: {error}; its requests go to the {len(self.live)} other servers, "
                      "and it is left out until it answers again")
        if self._broadcast is not None:
            self._broadcast.members_changed()
        self._recovery.restart(i)

    def _take_back(self, version: int) -> list[int]:
        """Servers left out that answer /health_generate again join the live ones now, at a weight
        update, which gives them the weights of `version` (see server_recovery.py)."""
        back = self._recovery.answering(sorted(self._failed - set(self.live)), self.urls)
        for i in back:
            self._failed.discard(i)
            self._http.mark_up(i)
            self._server_infos.pop(i, None)  # a restarted server is asked again
            console.print(f"SGLang server {i} ({self.urls[i]}) answers again: taken back with the weights of "
                          f"version {version}", highlight=False, soft_wrap=True)
        if back:
            self.live = sorted(self.live + back)
            if self._broadcast is not None:
                self._broadcast.members_changed()
        return back

    def _down_error(self, i: int, err: Exception, what: str, may_exit: bool = True,
                    server: ServerProcess | None = None) -> UserError:
        """The error for server i (or the process given: the router) that failed a request."""
        server = server or self._server(i)
        if server is not None:
            # the socket closes a moment before the process can be reaped (a hung one will not exit)
            deadline = time.monotonic() + (3.0 if may_exit else 0.0)
            while server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not server.alive():
                return server.crash_error()
            return UserError(f"{server.label} ({server.url}) {what}: {err}; log: {server.log_path}")
        return UserError(f"SGLang server {self.urls[i]} {what}: {err} (is it running? rollout.urls)")

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> requests.Response:
        """POST to server i; an error naming it when it cannot be reached."""
        try:
            return self._session().post(self.urls[i] + path, json=body, timeout=timeout)
        except requests.RequestException as err:
            raise self._down_error(i, err, f"unreachable on {path}") from None

    def _get_info(self, i: int, path: str) -> dict:
        """GET /<path>, or its pre-0.5 name /get_<path> where the server does not know the new one."""
        r = self._session().get(self.urls[i] + "/" + path, timeout=30)
        if r.status_code == 404:
            r = self._session().get(self.urls[i] + "/get_" + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def model_info(self, i: int = 0) -> dict:
        return self._get_info(i, "model_info")

    def server_info(self, i: int) -> dict:
        """Server i's /server_info, asked once ({} where it does not answer it)."""
        if i not in self._server_infos:
            try:
                self._server_infos[i] = self._get_info(i, "server_info")
            except (requests.RequestException, ValueError):
                self._server_infos[i] = {}
        return self._server_infos[i]

    def context_len(self, i: int) -> int | None:
        """Server i's context length; None where /server_info does not say."""
        return context_length(self.server_info(i))

    def _endpoint_context(self, e: int) -> int | None:
        """The context a request sent to endpoint e must fit: behind the router, the smallest one."""
        if self.router is None:
            return self.context_len(e)
        known = [c for c in (self.context_len(i) for i in self.live) if c is not None]
        return min(known) if known else None

    def _expected_version(self, e: int) -> str | None:
        """The weight_version answers from endpoint e must carry (None: not set by this engine)."""
        if self.router is None:
            return self._weight_version[e]
        versions = {self._weight_version[i] for i in self.live}
        return versions.pop() if len(versions) == 1 else None

    def ensure_model(self, model_dir: str | Path, version: int) -> None:
        """Attached servers must serve `model_dir`: reload it where /get_model_info says otherwise."""
        for i in range(len(self.urls)):
            try:
                current = self.model_info(i).get("model_path")
            except (requests.RequestException, ValueError) as err:
                raise self._down_error(i, err, "did not answer /model_info") from None
            if current is None or not _same_model(current, model_dir):
                self._update_one(i, model_arg(model_dir), version)

    # -- generation ------------------------------------------------------------------------------
    def _apply(self, t: Trajectory, out: dict, params: SamplingParams, version: int, endpoint: int) -> None:
        meta = out.get("meta_info") or {}
        expected, got = self._expected_version(endpoint), meta.get("weight_version")
        if expected is not None and got is not None and str(got) != expected:
            raise UserError(f"SGLang server {self._gen_urls[endpoint]} answered with weight_version {got!r}, but this "
                            f"engine last set {expected!r}: someone else updated its weights (rollout.urls "
                            "servers must serve this run only)")
        apply_output(t, out, params, version)

    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None,
                 refill: Refill | None = None) -> list[Trajectory]:
        # `seed` is not sent: SGLang draws from its own --random-seed stream.
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        self._check_alive()
        todo = admit(trajs, params)
        if todo:
            GenerateCall(self, params, TokenBudget(token_budget), refill).run(todo)
        return trajs

    def _to_least_loaded(self, fresh: list[Trajectory], busy: list[int], groups: dict[str, int]) -> None:
        """Send each new group to the live server with the fewest requests in flight (where
        rollouts just finished), by entering it in `groups` as `GenerateCall._requests` reads it."""
        if self.router is not None:
            return
        load = {e: 0 for e in self.live}
        for e in busy:
            if e in load:
                load[e] += 1
        for t in fresh:
            gid = t.group_id or t.uid
            if gid not in groups:
                groups[gid] = self.live.index(min(self.live, key=load.__getitem__))
            load[self.live[groups[gid] % len(self.live)]] += 1

    # -- weights ---------------------------------------------------------------------------------
    def _update_one(self, i: int, model_path: str, version: int) -> None:
        self.control(i, "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}, 3600.0)
        self._weight_version[i] = str(version)  # the update flushed the server's prefix cache too

    def update_weights_from_disk(self, model_dir: str | Path, version: int) -> None:
        self._check_alive()
        model_path = model_arg(model_dir)
        back = set(self._take_back(version))
        with ThreadPoolExecutor(max_workers=min(len(self.live), 32)) as pool:
            futures = {i: pool.submit(self._update_one, i, model_path, version) for i in self.live}
            for i, fut in futures.items():
                try:
                    fut.result()
                except UserError as err:
                    if i not in back:
                        raise
                    self._leave_out(i, err)  # taken back too soon: out again (only retry takes servers back)
        self.version = version
        self.verify_export(model_dir, version)

    def verify_export(self, model_dir: str | Path, version: int, when: str | None = None) -> None:
        """Each server serves the weights of the HF directory `model_dir` (the trainer's export, or
        the stage's starting model); a hub id has no local rows to compare."""
        if Path(model_dir).is_dir():
            self.verify_weights(lambda wc: wc.export_slices(model_dir, version), version, when)

    def verify_weights(self, expected: Callable, version: int, when: str | None = None) -> None:
        """The fingerprint after a push: each live server serves the trainer's weights (weight_check.py;
        imported here: it needs torch, the HTTP client does not)."""
        import torch

        from rlrecipe.rollout import weight_check

        served = getattr(torch, self.served_dtype) if self.served_dtype else None
        t0 = time.perf_counter()
        weight_check.check_servers(self, expected(weight_check), version, served, when)
        self.weight_check_s = time.perf_counter() - t0  # the trainer's rows read, every server asked

    def control(self, i: int, path: str, body: dict, read_timeout: float) -> None:
        """POST a control request that answers {success, message}; raise unless it succeeded."""
        r = self.post(i, path, body, timeout=(30.0, read_timeout))
        try:
            body = r.json()
        except ValueError:
            body = {"success": False, "message": r.text[:500]}
        if r.status_code != 200 or not body.get("success", False):
            raise UserError(f"SGLang server {self.urls[i]} {path} failed: {body.get('message', f'HTTP {r.status_code}')}")

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        """Broadcast the weights into the servers (weight_sync: distributed); nothing touches disk."""
        if self.transport is not WeightTransport.BROADCAST:
            raise NotImplementedError("SGLangEngine takes weights from disk unless rollout.sglang.weight_sync "
                                      "is distributed")
        self._check_alive()
        self._take_back(version)
        if self._broadcast is None:
            # imported here: the broadcast path needs torch, the HTTP client does not
            from rlrecipe.rollout.weight_broadcast import WeightBroadcast

            self._broadcast = WeightBroadcast(self)
        self._broadcast.push(state_dict, version)
        for i in self.live:
            self._weight_version[i] = str(version)
        self.version = version
        self.verify_weights(lambda wc: wc.state_slices(state_dict, version), version)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._recovery.close()
        if self._broadcast is not None:
            self._broadcast.close()
        self._http.close()
        for server in [self.router, *self.servers]:
            if server is not None:
                server.stop()
        with self._sessions_lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()