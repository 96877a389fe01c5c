"""One generate call on an SGLang fleet: its requests in flight until they all answer, or the budget stops them.

Each running trajectory becomes one /generate request, a group's samples on one server (which then
shares their prompt's prefix cache). A request whose server is left out (retry_on_other_servers)
is sent again, from the start, to another one.

C3PO++: with `token_budget`, once the trajectories finished during the call hold that many
response tokens, the requests in flight are aborted and come back partial (status RUNNING);
requests not yet sent are not sent. A later call resumes a partial trajectory by sending
prompt + partial response as `input_ids` with `max_new_tokens` reduced by what it has. Aborts:
the first round by rid; later rounds, on servers this engine launched (nobody else's requests
are there), abort all, since SGLang acts on a rid's first abort only and may miss it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import requests

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.base import SEED_KEY, Refill
from rlrecipe.rollout.c3po_budget import TokenBudget
from rlrecipe.rollout.sglang.api import apply_output, context_length, generate_payload, sglang_sampling_params
from rlrecipe.rollout.sglang.down import leave_out_down
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.http_pool import Post, PostFailed
from rlrecipe.rollout.sglang.versions import NEWEST, Dialect, room
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory

ABORT_RESEND_S = 1.0


@dataclass(eq=False)
class Request:
    traj: Trajectory
    endpoint: int  # index into the engine's generation URLs: a server, or 0 = the router
    payload: dict
    rid: str
    post: Post | None = None
    lost: bool = False  # its server was left out before it answered: send it again elsewhere
    left_outs_at_send: int = 0  # the fleet's servers left out so far, when it was sent


def apply_answer(fleet: ServerFleet, t: Trajectory, out: dict, params: SamplingParams, version: int,
                 endpoint: int) -> None:
    """Append endpoint's answer to `t`, once its weight_version is the one this engine last set."""
    meta = out.get("meta_info") or {}
    expected, got = fleet.expected_version(endpoint), meta.get("weight_version")
    if expected is not None and got is not None and str(got) != expected:
        raise UserError(f"SGLang server {fleet.gen_urls[endpoint]} answered with weight_version {got!r}, but this "
                        f"engine last set {expected!r}: someone else updated its weights (rollout.urls "
                        "servers must serve this run only)")
    apply_output(t, out, params, version)


def request_limits(fleet: ServerFleet, e: int) -> tuple[Dialect, int | None, int | None]:
    """What a request sent to endpoint e must respect: the dialect, the context length and
    max_req_input_len (None: not stated). Behind the router, the strictest of the live servers."""
    servers = [e] if fleet.router is None else list(fleet.live)
    dialects = [fleet.dialect(i) for i in servers]
    contexts = [c for c in (context_length(fleet.server_info(i)) for i in servers) if c is not None]
    inputs = [m for m in (fleet.server_info(i).get("max_req_input_len") for i in servers) if isinstance(m, int)]
    strict = min(dialects, key=lambda d: d.version or NEWEST)  # the oldest rules where versions differ
    return strict, (min(contexts) if contexts else None), (min(inputs) if inputs else None)


def to_least_loaded(live: list[int], fresh: list[Trajectory], busy: list[int], groups: dict[str, int]) -> None:
    """Send each new group to the live server with the fewest requests in flight (where rollouts
    just finished), by entering it in `groups` as `GenerateCall._requests` reads it."""
    load = {e: 0 for e in live}
    for e in busy:
        if e in load:
            load[e] += 1
    for t in fresh:
        gid = t.group_id or t.uid
        if gid not in groups:
            groups[gid] = live.index(min(live, key=load.__getitem__))
        load[live[groups[gid] % len(live)]] += 1


class GenerateCall:
    """The requests of one call and what becomes of each: answered, sent again elsewhere, withdrawn
    unsent or aborted once the budget is reached."""

    def __init__(self, fleet: ServerFleet, params: SamplingParams, budget: TokenBudget, refill: Refill | None, *,
                 stop_token_ids: Sequence[int], read_timeout: Callable[[int], float]):
        self.fleet, self.params, self.budget, self.refill = fleet, params, budget, refill
        self.stop_token_ids, self.read_timeout = list(stop_token_ids), read_timeout
        self.version = fleet.version
        self.adapter = fleet.adapter  # trainer.lora: the adapter of this version, named in every request
        self.groups: dict[str, int] = {}  # a group's server (see to_least_loaded)
        self.limits: dict[int, tuple] = {}  # each endpoint's dialect, context and input limit, asked once
        self.futures: dict[Future, Request] = {}
        self.pending: set[Future] = set()
        self.stopping = False
        self.last_abort, self.abort_rounds = 0.0, 0

    def run(self, todo: list[Trajectory]) -> None:
        self._send(self._requests(todo))
        try:
            while self.pending:
                done, self.pending = wait(self.pending, timeout=0.25, return_when=FIRST_COMPLETED)
                ended = self._take(done)
                if not self.stopping and self.budget.reached:
                    self.stopping = True
                    # not sent yet: withdrawn, the trajectory stays as it is
                    self.pending = {f for f in self.pending if not self.fleet.http.withdraw(self.futures[f].post)}
                elif not self.stopping and self.refill is not None and ended:
                    self._refill(ended)
                if self.stopping and self.pending and time.monotonic() - self.last_abort > ABORT_RESEND_S:
                    self._abort([self.futures[f] for f in self.pending if self.futures[f].post.sent],
                                all_on_own_servers=self.abort_rounds > 0)
                    self.last_abort, self.abort_rounds = time.monotonic(), self.abort_rounds + 1
                self.fleet.check_alive()
        except BaseException:
            sent = [self.futures[f] for f in self.pending
                    if not self.fleet.http.withdraw(self.futures[f].post) and not f.done()]
            self._abort(sent)  # servers left out are among the failed: none is asked
            raise

    def _send(self, reqs: list[Request]) -> None:
        for req in reqs:
            fut = self._submit(req)
            self.futures[fut] = req
            self.pending.add(fut)

    def _take(self, done: set[Future]) -> int:
        """The answers of `done` applied; lost requests sent again. How many trajectories ended."""
        ended = 0
        for fut in done:
            req = self.futures.pop(fut)
            out = self._answer(req, fut)
            if out is not None:
                apply_answer(self.fleet, req.traj, out, self.params, self.version, req.endpoint)
                ended += self.budget.count(req.traj)
            elif req.lost and not self.stopping:
                # its server was left out: the same request, from the start, on another
                live = self.fleet.live
                req.endpoint = 0 if self.fleet.router is not None else live[hash(req.rid) % len(live)]
                req.payload = {**req.payload, "rid": uuid.uuid4().hex}
                req.rid, req.lost = req.payload["rid"], False
                self.fleet.resent += 1
                self._send([req])
        return ended

    def _refill(self, ended: int) -> None:
        """New groups for the `ended` trajectories' slots, each to the least loaded server."""
        fresh = self.refill(ended)
        while fresh:
            if self.fleet.router is None:
                to_least_loaded(self.fleet.live, fresh, [self.futures[f].endpoint for f in self.pending],
                                self.groups)
            self._send(self._requests(fresh))
            # a prompt that fills the server's context ends unsent: its slot is free again
            full = sum(t.done for t in fresh)
            fresh = self.refill(full) if full else []

    def _requests(self, todo: list[Trajectory]) -> list[Request]:
        """One request per running trajectory, each group's samples to one server (which then
        shares their prompt's prefix cache)."""
        eng, params = self.fleet, self.params
        reqs: list[Request] = []
        for t in todo:
            if eng.router is not None:
                endpoint = 0  # the router keeps a prompt's samples together itself (cache_aware)
            else:
                endpoint = eng.live[self.groups.setdefault(t.group_id or t.uid, len(self.groups)) % len(eng.live)]
            input_ids = list(t.prompt_ids) + list(t.response_ids)
            max_new = params.max_new_tokens - len(t.response_ids)
            if endpoint not in self.limits:
                self.limits[endpoint] = request_limits(eng, endpoint)
            dialect, ctx, max_input = self.limits[endpoint]
            left = room(dialect, ctx, max_input, len(input_ids))
            if left is not None:
                max_new = min(max_new, left)
                if max_new <= 0:  # the context is full: it can never finish
                    t.status = Status.TRUNCATED
                    t.meta["truncated_by_server"] = True
                    continue
            rid = uuid.uuid4().hex  # fixed length: SGLang matches abort rids by prefix
            sp = sglang_sampling_params(params, max_new, self.stop_token_ids)
            # an unexpected keyword before 0.5.3 (HTTP 500); exact only with --enable-deterministic-inference
            if SEED_KEY in t.meta and dialect.sampling_seed:
                sp["sampling_seed"] = int(t.meta[SEED_KEY])
            payload = generate_payload(input_ids, sp, rid)
            if self.adapter is not None:
                payload["lora_path"] = self.adapter
            reqs.append(Request(t, endpoint, payload, rid))
        return reqs

    def _submit(self, req: Request) -> Future:
        eng = self.fleet
        max_new = req.payload["sampling_params"]["max_new_tokens"]
        req.left_outs_at_send = eng.left_out_count
        req.post = Post(req.endpoint, eng.gen_urls[req.endpoint] + "/generate", req.payload,
                        self.read_timeout(max_new))
        return eng.http.submit(req.post)

    def _answer(self, req: Request, fut: Future) -> dict | None:
        """The server's JSON for a finished request; None when it went unsent or must go elsewhere."""
        eng = self.fleet
        try:
            result = fut.result()
        except PostFailed as err:
            if req.endpoint in eng.failed and eng.cfg.retry_on_other_servers:
                req.lost = True  # its server was reported and left out already
                return None
            if err.timed_out:
                what = (f"did not answer /generate within {req.post.read_timeout_s:.0f} s (hung? the limit is "
                        "rollout.sglang.request_timeout_s + request_timeout_per_token_s x max_new_tokens, "
                        "times the turns a request may queue for the KV cache)")
            else:
                what = "failed during /generate"
            if self._behind_router_a_server_was_down(req):
                return None
            if eng.router is not None:
                raise eng.down_error(0, err, f"{what}; servers behind it: {', '.join(eng.urls)}",
                                      may_exit=not err.timed_out, server=eng.router) from None
            eng.leave_out(req.endpoint, eng.down_error(req.endpoint, err, what, may_exit=not err.timed_out))
            req.lost = True
            return None
        if result is None:
            return None
        status, text = result
        if status >= 500 and self._behind_router_a_server_was_down(req):
            return None
        if status != 200:
            raise UserError(f"SGLang server {eng.gen_urls[req.endpoint]} /generate: HTTP {status}: {text[:500]}")
        return json.loads(text)

    def _behind_router_a_server_was_down(self, req: Request) -> bool:
        """Behind the router, with retry_on_other_servers: a /generate that failed while a server was
        down (found now, or left out since it was sent) is marked lost, to be sent again."""
        eng = self.fleet
        if eng.router is None or not eng.cfg.retry_on_other_servers:
            return False
        if leave_out_down(eng) or eng.left_out_count > req.left_outs_at_send:
            req.lost = True
            return True
        return False

    def _abort(self, reqs: Sequence[Request], all_on_own_servers: bool = False) -> None:
        """Abort these requests by rid; with `all_on_own_servers`, servers this engine launched
        abort everything instead (SGLang acts on a rid's first abort only, and may miss it). Behind
        the router, which forwards no aborts and does not tell where a request went, every server
        aborts everything (its servers serve this run only)."""
        eng = self.fleet
        bodies: list[tuple[int, dict]] = []
        if eng.router is not None:
            if reqs:
                bodies = [(server, {"abort_all": True}) for server in eng.live if server not in eng.failed]
        else:
            for server in sorted({r.endpoint for r in reqs} - eng.failed):
                if all_on_own_servers and eng.server(server) is not None:
                    bodies.append((server, {"abort_all": True}))
                else:
                    bodies += [(server, {"rid": r.rid}) for r in reqs if r.endpoint == server]
        failed: set[int] = set()
        for server, body in bodies:
            if server in failed:
                continue  # one unanswered abort is enough: don't wait on it once per request
            try:
                eng.session().post(eng.urls[server] + "/abort_request", json=body, timeout=10)
            except requests.RequestException:
                failed.add(server)  # the /generate call reports a dead server
