"""The SGLang servers an engine talks to: launched or attached, which are in use, and requests to one.

The fleet launches its servers (`sglang/server.py`) or attaches to running ones (`rollout.urls`),
with sglang-router in front of them where asked (every /generate then goes to the router; weight
updates, aborts and server info still go to each server, since the router forwards none of
them). It keeps which servers are still in use: a server that dies or stays silent stops the call
with an error naming it, or (retry_on_other_servers) it is left out until it answers again
(`sglang/recovery.py`: with `max_restarts` a launched one is started again; any one answering
again is taken back at the next weight update). It also keeps what each server was last told to
serve (`weight_version`), which the generation side checks every answer against.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests

from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import RolloutSection, SGLangServer
from rlrecipe.rollout.sglang import lora
from rlrecipe.rollout.sglang.api_key import client_headers, fleet_key, user_key
from rlrecipe.rollout.sglang.health import wait_until_healthy
from rlrecipe.rollout.sglang.http_pool import HttpPool
from rlrecipe.rollout.sglang.recovery import ServerRecovery
from rlrecipe.rollout.sglang.router import RouterWorkers, start_router
from rlrecipe.rollout.sglang.server import ServerProcess, launch_servers
from rlrecipe.rollout.sglang.versions import NEWEST, Dialect, dialect_of

# a /server_info that fails is asked this often in all, this far apart, before an error names the server
SERVER_INFO_TRIES, SERVER_INFO_PAUSE_S = 3, 1.0


class ServerFleet:
    """SGLang servers (and the router, if any): their URLs, which are live, and one request to each."""

    def __init__(self, urls: Sequence[str], *, cfg: SGLangServer | None = None, max_concurrency: int = 512,
                 servers: Sequence[ServerProcess] | None = None, router: ServerProcess | None = None,
                 key: str | None = None):
        if not urls:
            raise UserError("rollout.urls: no SGLang server to talk to")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg or SGLangServer()
        self.servers: list[ServerProcess] = list(servers or [])
        self.router = router  # sglang-router in front of the servers: every /generate goes to it
        # what every request carries: the key the fleet drew for its servers, or the user's
        self.key = key or user_key()
        self.routed = RouterWorkers(router, self.session) if router is not None else None
        self.unrouted: set[int] = set()  # left out, so off the router's list until a push reaches them
        self.gen_urls = [router.url] if router is not None else self.urls
        # every /generate goes through one asyncio thread, at most max_concurrency open per server
        self.http = HttpPool(len(self.gen_urls), max_concurrency * (len(self.urls) if router else 1), self.key)
        self.live = list(range(len(self.urls)))  # servers still in use (retry_on_other_servers drops some)
        self.failed: set[int] = set()  # servers that died or hung under this engine (until taken back)
        self.left_out_count = 0  # times a server was left out (behind the router: which requests it cut)
        self.resent = 0  # requests sent again, from the start, after their server was left out
        self.recovery = ServerRecovery(self.servers, self.cfg.max_restarts)
        self.server_infos: dict[int, dict] = {}  # answers only: a failed /server_info is asked again
        self._unversioned: set[int] = set()  # servers already warned of for stating no version
        self.version = 0  # the policy version new tokens are labelled with
        self.weight_version: list[str | None] = [None] * len(self.urls)  # None: not set by this engine
        self.adapter: str | None = None  # trainer.lora: the adapter every /generate names (sglang/lora.py)
        # this fleet's own adapter names: two runs on the same attached servers never share one
        self.adapter_prefix = lora.adapter_prefix()
        self.retired_adapters: list[str] = []  # loaded by this fleet and replaced: unloaded at the next push
        # called when the set of live servers changes (the broadcast group counts the old set)
        self.on_members_changed: Callable[[], None] | None = None
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._sessions_lock = threading.Lock()
        if self.routed is not None and self.cfg.retry_on_other_servers:
            # servers may be left out: the router must let its list be changed (asked now, so a router
            # without the API stops the run at start), once it registered its servers (in the background)
            self.routed.wait_for(self.urls)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def attach(cls, ro: RolloutSection, run_dir: Path | None) -> ServerFleet:
        """A fleet over rollout.urls, with the router in front of them where asked; they are sent the
        user's key (SGLANG_API_KEY) only."""
        urls = [u.rstrip("/") for u in ro.urls]
        # attached servers may still be starting (or restarting): the same bounded wait as launched ones
        wait_until_healthy([(u, None) for u in urls], ro.sglang.startup_timeout_s)
        router = start_router(urls, ro.sglang, run_dir, key=user_key()) if ro.sglang.router else None
        try:
            return cls(urls, cfg=ro.sglang, max_concurrency=ro.sglang.max_concurrency, router=router)
        except BaseException:
            if router is not None:
                router.stop()
            raise

    @classmethod
    def launch(cls, model_dir: str | Path, cfg: SGLangServer, *, dtype: str, run_dir: str | Path | None, seed: int,
               launch_cmd: Sequence[str] | Callable[[int, int], list[str]] | None,
               env: dict[str, str] | None, trainer_gpus: int, memory_saver: bool = False,
               kv_cache_dtype: str = "auto", lora_args: Sequence[str] = ()) -> ServerFleet:
        """Start `cfg.num_servers` servers (see `launch_servers`) and, with `cfg.router`, the router in
        front of them; wait until they generate and prove they are the ones launched. Without
        SGLANG_API_KEY the servers get a key drawn for this fleet alone (api_key.fleet_key)."""
        key = fleet_key()
        servers: list[ServerProcess] = []
        router = None
        try:
            servers = launch_servers(model_dir, cfg, dtype=dtype, run_dir=run_dir, seed=seed, launch_cmd=launch_cmd,
                                     env=env, trainer_gpus=trainer_gpus, memory_saver=memory_saver,
                                     kv_cache_dtype=kv_cache_dtype, lora_args=lora_args, key=key)
            wait_until_healthy([(s.url, s) for s in servers], cfg.startup_timeout_s)
            if cfg.router:
                router = start_router([s.url for s in servers], cfg, servers[0].log_path.parent, env, key)
            return cls([s.url for s in servers], cfg=cfg, max_concurrency=cfg.max_concurrency, servers=servers,
                       router=router, key=key)
        except BaseException:
            for s in [router, *servers]:
                if s is not None:
                    s.stop()
            raise

    # -- health ----------------------------------------------------------------------------------
    def server(self, i: int) -> ServerProcess | None:
        """The process of server i where this fleet launched it."""
        return self.servers[i] if i < len(self.servers) else None

    def check_alive(self) -> None:
        if self.router is not None and self.router.proc is not None and not self.router.alive():
            raise self.router.crash_error()
        for i, s in enumerate(self.servers):
            if i in self.live and s.proc is not None and not s.alive():
                self.leave_out(i, s.crash_error())

    def leave_out(self, i: int, error: UserError) -> None:
        """Server i died or hung: raise `error`, or with retry_on_other_servers, stop using it."""
        self.failed.add(i)  # nothing more is asked of it on the way out (aborts)
        if not self.cfg.retry_on_other_servers:
            raise error
        if i not in self.live:
            return  # left out already (its other requests fail the same way)
        self.live.remove(i)
        self.left_out_count += 1
        if self.routed is None:
            self.http.mark_down(i)
        if not self.live:
            raise UserError(f"{error}; no SGLang server left to retry on") from None
        if self.routed is not None:
            self.routed.remove(self.urls[i])
            self.unrouted.add(i)
        console.print(f"[yellow]warning[/]: {error}; its requests go to the {len(self.live)} other servers, "
                      "and it is left out until it answers again")
        if self.on_members_changed is not None:
            self.on_members_changed()
        self.recovery.restart(i)

    def take_back(self, version: int) -> list[int]:
        """Servers left out that answer /health_generate again join the live ones now, at a weight
        update, which gives them the weights of `version` (see sglang/recovery.py)."""
        back = self.recovery.answering(sorted(self.failed - set(self.live)), self.urls)
        for i in back:
            self.failed.discard(i)
            if self.routed is None:
                self.http.mark_up(i)
            self.server_infos.pop(i, None)  # a restarted server is asked again
            self._unversioned.discard(i)
            console.print(f"SGLang server {i} ({self.urls[i]}) answers again: taken back with the weights of "
                          f"version {version}", highlight=False, soft_wrap=True)
        if back:
            self.live = sorted(self.live + back)
            if self.on_members_changed is not None:
                self.on_members_changed()
        return back

    def pushed(self, version: int) -> None:
        """A push of `version` reached every live server: new tokens carry it, and servers taken back
        at this push go back on the router's list (none before: the router would sample from them)."""
        self.version = version
        for i in sorted(self.unrouted & set(self.live)):
            self.routed.add(self.urls[i])
            self.unrouted.discard(i)

    def down_error(self, i: int, err: Exception, what: str, may_exit: bool = True,
                   server: ServerProcess | None = None) -> UserError:
        """The error for server i (or the process given: the router) that failed a request."""
        server = server or self.server(i)
        if server is not None:
            # the socket closes a moment before the process can be reaped (a hung one will not exit)
            deadline = time.monotonic() + (3.0 if may_exit else 0.0)
            while server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not server.alive():
                return server.crash_error()
            return UserError(f"{server.label} ({server.url}) {what}: {err}; log: {server.log_path}")
        return UserError(f"SGLang server {self.urls[i]} {what}: {err} (is it running? rollout.urls)")

    def metrics(self) -> dict[str, float]:
        """Servers in use, the restarts spent and the requests sent again so far (by the client, and
        by the router where one is in front): a run losing servers shows in its metrics."""
        spent = sum(self.cfg.max_restarts - left for left in self.recovery.restarts_left.values())
        out = {"rollout_servers_live": float(len(self.live)), "rollout_server_restarts": float(spent),
               "rollout_requests_resent": float(self.resent)}
        retries = self.routed.retries() if self.routed is not None else None
        if retries is not None:  # behind the router, the requests it resent itself
            out["rollout_router_retries"] = float(retries)
        return out

    # -- requests to one server ------------------------------------------------------------------
    def session(self) -> requests.Session:
        """This thread's HTTP session (keep-alive), with the API key."""
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(client_headers(self.key))
            with self._sessions_lock:
                self._sessions.append(s)
        return s

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> requests.Response:
        """POST to server i; an error naming it when it cannot be reached."""
        try:
            return self.session().post(self.urls[i] + path, json=body, timeout=timeout)
        except requests.RequestException as err:
            raise self.down_error(i, err, f"unreachable on {path}") from None

    def control(self, i: int, path: str, body: dict, read_timeout: float) -> None:
        """POST a control request that answers {success, message}; raise unless it succeeded."""
        r = self.post(i, path, body, timeout=(30.0, read_timeout))
        try:
            body = r.json()
        except ValueError:
            body = {"success": False, "message": r.text[:500]}
        if r.status_code != 200 or not body.get("success", False):
            raise UserError(f"SGLang server {self.urls[i]} {path} failed: {body.get('message', f'HTTP {r.status_code}')}")

    def get_info(self, i: int, path: str) -> dict:
        """GET /<path>, or its pre-0.5 name /get_<path> where the server does not know the new one."""
        r = self.session().get(self.urls[i] + "/" + path, timeout=30)
        if r.status_code == 404:
            r = self.session().get(self.urls[i] + "/get_" + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def model_info(self, i: int = 0) -> dict:
        return self.get_info(i, "model_info")

    def server_info(self, i: int) -> dict:
        """Server i's /server_info, kept once it answered. A failure is never kept: its version decides
        what a request may carry (a 0.5.1 server taken for the newest is sent sampling_seed and too
        many new tokens), so it is asked again a few times, then an error names the server, and the
        next use asks again."""
        if i in self.server_infos:
            return self.server_infos[i]
        for attempt in range(SERVER_INFO_TRIES):
            if attempt:
                time.sleep(SERVER_INFO_PAUSE_S)
            try:
                info = self.get_info(i, "server_info")
            except (requests.RequestException, ValueError) as err:
                failure: Exception = err
                continue
            if isinstance(info, dict):
                self.server_infos[i] = info
                return info
            failure = ValueError(f"not a JSON object: {str(info)[:200]}")
        raise self.down_error(i, failure, f"/server_info failed {SERVER_INFO_TRIES} times (its SGLang version "
                                          "decides what a request may carry, so it is not guessed)")

    def dialect(self, i: int) -> Dialect:
        """The rules of server i's SGLang version (from its /server_info). One that answers without a
        version it states is spoken to as the newest of the pin (sglang/versions.py), and told so once."""
        dialect = dialect_of(self.server_info(i))
        if dialect.version is None and i not in self._unversioned:
            self._unversioned.add(i)
            console.print(f"[yellow]warning[/]: SGLang server {self.urls[i]} states no version in /server_info "
                          f"(version: {self.server_info(i).get('version')!r}): it is spoken to as "
                          f"{'.'.join(map(str, NEWEST))}, the newest the client was checked against, with the "
                          "stricter context edge", highlight=False, soft_wrap=True)
        return dialect

    def expected_version(self, e: int) -> str | None:
        """The weight_version answers from endpoint e must carry (None: not set by this engine)."""
        if self.router is None:
            return self.weight_version[e]
        versions = {self.weight_version[i] for i in self.live}
        return versions.pop() if len(versions) == 1 else None

    def close(self) -> None:
        """Stop what this fleet started: restarts, the request thread, the servers and the router."""
        self.recovery.close()
        self.http.close()
        for server in [self.router, *self.servers]:
            if server is not None:
                server.stop()
        with self._sessions_lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()
