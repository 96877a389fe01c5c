"""`rlrecipe serve`: SGLang's native HTTP API (the subset the SGLang engine uses) on the CPU engine.

So the SGLang rollout path (client, server lifecycle, partial rollouts, weight sync) runs and is
tested on machines where SGLang cannot: `rollout.sglang.launch_cmd` set to
`["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}"]`, or a server started
by hand and attached with `rollout.urls`.

Endpoints (request and response shapes as SGLang's): POST /generate (input_ids or text, single
or batch; sampling_params; return_logprob; rid), POST /abort_request, POST
/update_weights_from_disk (flushes the cache, as SGLang's does), POST|GET /flush_cache,
POST /init_weights_update_group + /update_weights_from_distributed + /destroy_weights_update_group
(the trainer broadcasts tensors into this process, see rollout/weight_sync.py), GET /health,
GET /health_generate, GET /model_info (and its old name /get_model_info), GET
/server_info (context_length). As in SGLang (without --allow-auto-truncate), a request whose
input + max_new_tokens exceeds the context length is refused with HTTP 400.

One scheduler thread owns the `InProcessEngine`. It gathers the requests that arrive within a
few milliseconds of each other and decodes them together, in chunks of `chunk_tokens` new
tokens; between chunks it admits new requests and applies aborts, so an aborted request returns
within one chunk with what it has (finish_reason abort). Each chunk re-prefills prompt + output
so far, the same operation as resuming a partial rollout; for the small CPU models this serves,
that costs little next to the chunk's decoding steps. A weight update waits until no request
runs and holds new ones back meanwhile (as SGLang's model-update lock does).

Also: stop strings (`sampling_params.stop`: the text is cut before the match unless
no_stop_trim; finish_reason matched is the string) and `n` parallel samples (results prompt by
prompt, rids suffixed _0.._n-1, a list even for one prompt), and `stream` for one prompt (server-
sent events, each with the output so far, as SGLang streams by default). Not supported (HTTP
400): batch streams, logprob_start_len >= 0 (prompt log-probs), min_new_tokens. `ignore_eos`
runs to max_new_tokens.
"""

from __future__ import annotations

import datetime
import json
import math
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch.distributed as dist

from rlrecipe.errors import UserError
from rlrecipe.rollout.weight_sync import DEFAULT_GROUP, init_custom_group, receive
from rlrecipe.trajectory import SamplingParams, Trajectory

# /init_weights_update_group waits this long for the trainer's rendezvous, not the 10 minutes a
# weight broadcast may take: an unreachable address must not hold the request that long.
JOIN_TIMEOUT_S = 120.0
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens", "stop", "min_new_tokens",
                 "n", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed"}
GATHER_S = 0.005


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class BadRequest(Exception):
    pass


@dataclass(eq=False)
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset[int]
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop_strs: tuple[str, ...] = ()
    ignore_eos: bool = False  # throughput tests: run to max_new_tokens (the engine stops at eos; the next chunk goes on)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    abort: bool = False
    arrived: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> tuple:
        return (self.temperature, self.top_p, self.top_k)

    def finish_with(self, reason: dict) -> None:
        self.finish = reason
        self.done.set()


def parse_sampling(sp: dict | None, context_len: int, n_input: int) -> dict:
    sp = dict(sp or {})
    unknown = set(sp) - SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling_params: {sorted(unknown)}")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    if sp.get("min_new_tokens"):
        raise BadRequest("sampling_params.min_new_tokens is not supported by rlrecipe serve")
    n = sp.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise BadRequest("sampling_params.n must be an integer >= 1")
    for k, neutral in (("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("repetition_penalty", 1.0)):
        if sp.get(k, neutral) != neutral:
            raise BadRequest(f"sampling_params.{k} is not supported by rlrecipe serve")
    temperature = float(sp.get("temperature", 1.0))
    top_p = float(sp.get("top_p", 1.0))
    top_k = int(sp.get("top_k", -1))
    if not 0 <= temperature < math.inf or not 0 < top_p <= 1 or (top_k < 1 and top_k != -1):  # NaN fails too
        raise BadRequest(f"bad sampling_params: temperature={temperature} top_p={top_p} top_k={top_k} "
                         "(top_k must be -1 (off) or >= 1)")
    max_new = int(sp.get("max_new_tokens", 128))
    if max_new < 0:
        raise BadRequest("sampling_params.max_new_tokens must be >= 0")
    # as SGLang without --allow-auto-truncate: a request that cannot fit is refused, not shortened
    if n_input >= context_len:
        raise BadRequest(f"The input ({n_input} tokens) is longer than the model's context length "
                         f"({context_len} tokens).")
    if n_input + max_new > context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} "
                         f"tokens: {n_input} input + {max_new} new.")
    return {"max_new_tokens": max_new, "temperature": temperature, "top_p": top_p,
            "top_k": 0 if top_k == -1 else top_k, "stop_ids": frozenset(int(t) for t in sp.get("stop_token_ids") or []),
            "skip_special_tokens": bool(sp.get("skip_special_tokens", True)),
            "no_stop_trim": bool(sp.get("no_stop_trim", False)), "stop_strs": tuple(stop), "n": n,
            "ignore_eos": bool(sp.get("ignore_eos", False))}


class Scheduler:
    """Owns the engine: batches requests, decodes them in chunks, applies aborts and weight updates."""

    def __init__(self, engine, tokenizer, model_path: str, context_len: int, chunk_tokens: int = 16,
                 seed: int = 0, join_timeout_s: float = JOIN_TIMEOUT_S):
        self.engine = engine
        self.join_timeout_s = join_timeout_s
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.weight_version = "default"
        self.context_len = context_len
        # ids at or past it would index out of the embedding and fail the whole batch they join
        self.vocab_size = int(engine.model.get_input_embeddings().num_embeddings)
        self.chunk = max(1, chunk_tokens)
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.pending: list[GenRequest] = []
        self.active: list[GenRequest] = []
        self.updates: list[dict] = []
        self.groups: dict[str, object] = {}  # weight update groups joined, by name
        self.stopped = False
        self._turn = 0
        self._tokens = 0
        self._last_report = time.time()
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    # -- called from HTTP threads -----------------------------------------------------------------
    def submit(self, reqs: list[GenRequest]) -> None:
        with self.cond:
            for r in reqs:
                if r.max_new_tokens == 0:
                    r.finish_with({"type": "length", "length": 0})
                else:
                    self.pending.append(r)
            self.cond.notify_all()

    def abort(self, rid: str, abort_all: bool = False) -> int:
        if not rid and not abort_all:
            return 0
        n = 0
        with self.cond:
            for r in self.pending + self.active:
                if not r.done.is_set() and (abort_all or r.rid.startswith(rid)):  # prefix match, as SGLang
                    r.abort = True
                    n += 1
            self.cond.notify_all()
        return n

    def update_weights(self, model_path: str, weight_version: str | None, timeout: float = 3600.0) -> dict:
        return self._run_update({"model_path": model_path, "weight_version": weight_version}, timeout)

    def update_weights_from_distributed(self, body: dict, timeout: float = 3600.0) -> dict:
        group = self.groups.get(body.get("group_name", DEFAULT_GROUP))
        if group is None:
            raise BadRequest(f"no weight update group {body.get('group_name', DEFAULT_GROUP)!r}: "
                             "call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must be lists of one length")
        own = self.engine.model.state_dict()
        for name, shape in zip(names, shapes, strict=True):
            if name not in own or list(own[name].shape) != list(shape):
                raise BadRequest(f"tensor {name} {shape} does not fit the served model")
        return self._run_update({"group": group, "names": names, "dtypes": dtypes, "shapes": shapes,
                                 "weight_version": body.get("weight_version")}, timeout)

    def init_group(self, body: dict) -> dict:
        """Join the trainer's weight update group (blocks until every member has joined)."""
        try:
            name = str(body.get("group_name", DEFAULT_GROUP))
            if name in self.groups:  # a trainer that starts over replaces its group
                dist.destroy_process_group(self.groups.pop(name))
            self.groups[name] = init_custom_group(str(body.get("backend", "nccl")), str(body["master_address"]),
                                                  int(body["master_port"]), int(body["rank_offset"]),
                                                  int(body["world_size"]), name,
                                                  join_timeout=datetime.timedelta(seconds=self.join_timeout_s))
            log(f"joined weight update group {name} as rank {body['rank_offset']} of {body['world_size']}")
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        except Exception as err:  # noqa: BLE001 - reported to the client
            return {"success": False, "message": f"Failed to initialize custom process group: {err}."}

    def destroy_group(self, body: dict) -> dict:
        group = self.groups.pop(str(body.get("group_name", DEFAULT_GROUP)), None)
        if group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _run_update(self, job: dict, timeout: float) -> dict:
        job.update(done=threading.Event(), result=None)
        with self.cond:
            self.updates.append(job)
            self.cond.notify_all()
        if not job["done"].wait(timeout):
            return {"success": False, "message": "timed out waiting for running requests to finish"}
        return job["result"]

    # -- the scheduler thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.stopped or self.pending or self.active or self.updates):
                    self.cond.wait()
                if self.stopped:
                    for r in self.pending + self.active:
                        r.finish_with({"type": "abort", "message": "server shutting down"})
                    return
            if not self.active and self.pending and not self.updates:
                time.sleep(GATHER_S)  # let requests sent together arrive together
            with self.cond:
                if not self.updates:  # an update holds new requests back until it is done
                    self.active += self.pending
                    self.pending = []
                for r in [r for r in self.pending + self.active if r.abort]:
                    r.finish_with({"type": "abort", "message": "Abort request " + r.rid})
                self.active = [r for r in self.active if not r.done.is_set()]
                self.pending = [r for r in self.pending if not r.done.is_set()]
                update = self.updates.pop(0) if self.updates and not self.active else None
            if update is not None:
                self._do_update(update)
            elif self.active:
                try:
                    self._decode_chunk()
                except Exception as err:  # noqa: BLE001 - fail the requests, keep serving
                    log(f"error while decoding: {type(err).__name__}: {err}")
                    for r in self.active:
                        r.finish_with({"type": "abort", "message": f"internal error: {err}", "status_code": 500})
                    self.active = []

    def _do_update(self, job: dict) -> None:
        t0 = time.time()
        try:
            if "group" in job:  # the trainer broadcasts the tensors as soon as it has sent the request
                tensors = receive(job["group"], job["names"], job["dtypes"], job["shapes"])
                self.engine.update_weights_from_state(dict(tensors), self.engine.version + 1)
                source = f"{len(tensors)} broadcast tensors"
            else:
                path = job["model_path"]
                if not (Path(path) / "config.json").exists():
                    raise FileNotFoundError(f"no model at {path}")
                self.engine.update_weights_from_disk(path, self.engine.version + 1)
                self.model_path = source = path
            if job["weight_version"] is not None:
                self.weight_version = str(job["weight_version"])
            msg = f"Succeeded to update model weights from {source} in {time.time() - t0:.2f}s."
            job["result"] = {"success": True, "message": msg, "num_paused_requests": 0}
            log(msg + f" weight_version={self.weight_version}")
        except Exception as err:  # noqa: BLE001 - reported to the client
            job["result"] = {"success": False, "message": f"Failed to update weights: {type(err).__name__}: {err}",
                             "num_paused_requests": 0}
            log(job["result"]["message"])
        job["done"].set()

    def _decode_chunk(self) -> None:
        keys = sorted({r.key for r in self.active}, key=lambda k: min(r.arrived for r in self.active if r.key == k))
        key = keys[self._turn % len(keys)]
        self._turn += 1
        rows = [r for r in self.active if r.key == key]
        steps = min(self.chunk, min(r.max_new_tokens - len(r.output_ids) for r in rows))
        temperature, top_p, top_k = key
        params = SamplingParams(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                                max_new_tokens=steps, greedy=temperature == 0)
        trajs = [Trajectory(uid=r.rid, prompt_ids=r.input_ids + r.output_ids) for r in rows]
        self.engine.generate(trajs, params, seed=self.rng.getrandbits(62))
        for r, t in zip(rows, trajs, strict=True):
            for tok, lp in zip(t.response_ids, t.logp_infer, strict=True):
                r.output_ids.append(tok)
                r.logprobs.append(lp)
                self._tokens += 1
                if (tok == self.engine.eos and not r.ignore_eos) or tok in r.stop_ids:
                    r.finish_with({"type": "stop", "matched": tok})
                    break
                matched = self._stop_string(r)
                if matched is not None:
                    r.finish_with({"type": "stop", "matched": matched})
                    break
            else:
                if len(r.output_ids) >= r.max_new_tokens:
                    r.finish_with({"type": "length", "length": r.max_new_tokens})
        now = time.time()
        if now - self._last_report > 5.0:
            log(f"decode: {len(self.active)} running, {len(self.pending)} waiting, "
                f"{self._tokens / (now - self._last_report):.0f} tok/s")
            self._tokens, self._last_report = 0, now

    def _stop_string(self, r: GenRequest) -> str | None:
        """The stop string the output now ends in, if any (only the tail can hold a new match)."""
        if not r.stop_strs:
            return None
        tail = self.tokenizer.decode(r.output_ids[-max(len(x) for x in r.stop_strs) - 8:])
        return next((x for x in r.stop_strs if x in tail), None)

    # -- responses --------------------------------------------------------------------------------
    def response(self, r: GenRequest) -> dict:
        """The response so far: final once `r.done` is set, else a streaming snapshot (no finish reason)."""
        finish = r.finish if r.done.is_set() else None
        n = min(len(r.output_ids), len(r.logprobs))  # the scheduler appends ids first, log-probs second
        ids, logprobs = r.output_ids[:n], r.logprobs[:n]
        shown = ids
        matched = (finish or {}).get("matched") if (finish or {}).get("type") == "stop" else None
        if isinstance(matched, int) and not r.no_stop_trim and ids:
            shown = ids[:-1]
        meta = {"id": r.rid, "finish_reason": finish, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.weight_version,
                "e2e_latency": time.time() - r.arrived}
        if r.return_logprob:
            texts = ([self.tokenizer.decode([t]) for t in ids] if r.return_text_in_logprobs else [None] * len(ids))
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(logprobs, ids, texts, strict=True)]
            meta["input_token_logprobs"] = []
        text = self.tokenizer.decode(shown, skip_special_tokens=r.skip_special_tokens)
        if isinstance(matched, str) and not r.no_stop_trim:
            text = text[:text.find(matched)] if matched in text else text
        return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _as_list(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name}: {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def build_requests(body: dict, sched: Scheduler) -> tuple[list[GenRequest], bool]:
    """A /generate body as requests, and whether it was a batch (list in, list out)."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("give exactly one of input_ids or text")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest("input_ids must be a list of integers or a list of such lists")
        batch = bool(ids) and isinstance(ids[0], list)
        inputs = ids if batch else [ids]
    else:
        batch = isinstance(text, list)
        if not all(isinstance(s, str) for s in (text if batch else [text])):
            raise BadRequest("text must be a string or a list of strings")
        inputs = [sched.tokenizer.encode(s) for s in (text if batch else [text])]
    n = len(inputs)
    if n == 0:
        raise BadRequest("empty batch")
    rid = body.get("rid")
    if isinstance(rid, list):
        rids = _as_list(rid, n, "rid")
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    else:
        rids = [str(rid)] if not batch else [f"{rid}_{i}" for i in range(n)]
    sps = _as_list(body.get("sampling_params"), n, "sampling_params")
    want_lp = _as_list(body.get("return_logprob", False), n, "return_logprob")
    starts = _as_list(body.get("logprob_start_len", -1), n, "logprob_start_len")
    out = []
    for i, seq in enumerate(inputs):
        if not isinstance(seq, list) or not seq or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in seq):
            raise BadRequest("input_ids must be non-empty lists of integers")
        if not all(0 <= t < sched.vocab_size for t in seq):
            bad = next(t for t in seq if not 0 <= t < sched.vocab_size)
            raise BadRequest(f"input_ids: token id {bad} is outside the vocabulary (0..{sched.vocab_size - 1})")
        if starts[i] is not None and starts[i] >= 0 and want_lp[i]:
            raise BadRequest("logprob_start_len >= 0 (prompt log-probs) is not supported by rlrecipe serve; use -1")
        sp = parse_sampling(sps[i], sched.context_len, len(seq))
        for j in range(sp["n"]):  # parallel samples come back prompt by prompt, as in SGLang
            rid_j = str(rids[i]) if sp["n"] == 1 else f"{rids[i]}_{j}"
            out.append(GenRequest(rid=rid_j, input_ids=list(seq), max_new_tokens=sp["max_new_tokens"],
                                  temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                                  stop_ids=sp["stop_ids"], return_logprob=bool(want_lp[i]),
                                  return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                                  skip_special_tokens=sp["skip_special_tokens"], no_stop_trim=sp["no_stop_trim"],
                                  stop_strs=sp["stop_strs"], ignore_eos=sp["ignore_eos"]))
    return out, batch or len(out) > 1


def make_handler(sched: Scheduler):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive for the engine's sessions
        server_version = "rlrecipe-serve"

        def log_message(self, format, *args):  # noqa: A002 - stdlib signature
            pass  # one line per request would drown the log; the scheduler reports instead

        def _send(self, code: int, body: dict | list | str | None = None) -> None:
            if body is None:
                data, ctype = b"", "text/plain"
            elif isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _reply(self, result: dict) -> None:
            """A control endpoint's {success, message, ...}: HTTP 400 when it did not succeed, as SGLang."""
            self._send(200 if result["success"] else 400, result)

        def _error(self, code: int, msg: str) -> None:
            self._send(code, {"object": "error", "message": msg, "type": "BadRequest" if code == 400 else "Error",
                              "code": code})

        def _body(self) -> dict:
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise BadRequest("Content-Length must be an integer") from None
            if n < 0:  # read(-1) would wait for the client to close the connection
                raise BadRequest("Content-Length must not be negative")
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return {}
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            return body

        def do_GET(self):  # noqa: N802 - stdlib naming
            path = self.path.split("?")[0]
            if path == "/health":
                self._send(200)
            elif path == "/health_generate":
                probe = GenRequest(rid=f"HEALTH_CHECK_{time.time()}", input_ids=[0], max_new_tokens=1, temperature=0.0,
                                   top_p=1.0, top_k=0, stop_ids=frozenset(), return_logprob=False,
                                   return_text_in_logprobs=False, skip_special_tokens=True, no_stop_trim=False)
                sched.submit([probe])
                self._send(200 if probe.done.wait(20) and probe.finish.get("type") != "abort" else 503)
            elif path in ("/model_info", "/get_model_info"):
                self._send(200, {"model_path": sched.model_path, "tokenizer_path": sched.model_path,
                                 "served_model_name": sched.model_path, "is_generation": True,
                                 "preferred_sampling_params": None, "weight_version": sched.weight_version})
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, {"model_path": sched.model_path, "context_length": sched.context_len,
                                 "max_req_input_len": sched.context_len - 1, "tp_size": 1, "dp_size": 1,
                                 "version": "rlrecipe-serve"})
            elif path == "/get_weight_version":
                self._send(200, {"weight_version": sched.weight_version})
            elif path == "/flush_cache":
                self._flush()
            else:
                self._error(404, f"no route GET {path}")

        def _stream(self, r: GenRequest) -> None:
            """Server-sent events as SGLang sends them by default: each event holds the whole output
            so far; the last one is the final response; then `data: [DONE]`. A client that hangs
            up aborts its request."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(data: bytes) -> None:
                self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            sent = 0
            try:
                while True:
                    finished = r.done.wait(0.02)
                    if finished or len(r.logprobs) > sent:
                        sent = len(r.logprobs)
                        event(b"data: " + json.dumps(sched.response(r)).encode() + b"\n\n")
                    if finished:
                        break
                event(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                sched.abort(r.rid)

        def _flush(self):
            self._send(200, "Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will not be performed.)\n")

        def do_POST(self):  # noqa: N802 - stdlib naming
            path = self.path.split("?")[0]
            try:
                body = self._body()
                if path in ("/generate", "/generate/"):
                    reqs, batch = build_requests(body, sched)
                    if body.get("stream") and (batch or len(reqs) != 1):
                        raise BadRequest("stream=true takes one prompt with n = 1 in rlrecipe serve")
                    sched.submit(reqs)
                    if body.get("stream"):
                        self._stream(reqs[0])
                        return
                    for r in reqs:
                        r.done.wait()
                    outs = [sched.response(r) for r in reqs]
                    self._send(200, outs if batch else outs[0])
                elif path == "/abort_request":
                    n = sched.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
                    if n:
                        log(f"abort {body.get('rid') or 'all'}: {n} request(s)")
                    self._send(200)
                elif path == "/update_weights_from_disk":
                    if not body.get("model_path"):
                        raise BadRequest("model_path is required")
                    log(f"update_weights_from_disk {body['model_path']}")
                    self._reply(sched.update_weights(str(body["model_path"]), body.get("weight_version")))
                elif path == "/init_weights_update_group":
                    self._reply(sched.init_group(body))
                elif path == "/update_weights_from_distributed":
                    self._reply(sched.update_weights_from_distributed(body))
                elif path == "/destroy_weights_update_group":
                    self._reply(sched.destroy_group(body))
                elif path == "/flush_cache":
                    self._flush()
                else:
                    self._error(404, f"no route POST {path}")
            except BadRequest as err:
                self._error(400, str(err))
            except (json.JSONDecodeError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
                self._error(400, f"bad request: {err!r}")

        def do_PUT(self):  # noqa: N802 - SGLang accepts PUT on /generate
            self.do_POST()

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 4096  # the engine opens hundreds of connections at once (stdlib default: 5)


def make_server(model: str | Path, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32", *,
                chunk_tokens: int = 16, max_batch: int = 256, seed: int = 0,
                join_timeout_s: float = JOIN_TIMEOUT_S) -> tuple[Server, Scheduler]:
    from rlrecipe.modeling import DTYPES, load_tokenizer
    from rlrecipe.rollout.inprocess import InProcessEngine

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if not (Path(model) / "config.json").exists():
        raise UserError(f"{model}: no model there (an HF directory with config.json)")
    t0 = time.time()
    tokenizer = load_tokenizer(model)
    engine = InProcessEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             dtype=dtype, max_batch=max_batch)
    context_len = int(getattr(engine.model.config, "max_position_embeddings", 0) or 1 << 30)
    sched = Scheduler(engine, tokenizer, str(model), context_len, chunk_tokens=chunk_tokens, seed=seed,
                      join_timeout_s=join_timeout_s)
    try:
        server = Server((host, port), make_handler(sched))
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    log(f"loaded {model} ({dtype}, context {context_len}) in {time.time() - t0:.1f}s")
    sched.start()
    return server, sched


def serve_forever(model: str | Path, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32", *,
                  chunk_tokens: int = 16, max_batch: int = 256, seed: int = 0) -> None:
    server, sched = make_server(model, host, port, dtype, chunk_tokens=chunk_tokens, max_batch=max_batch, seed=seed)

    def _terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _terminate)
    log(f"rlrecipe serve: ready on http://{host}:{port} (SGLang API subset; CPU in-process engine)")
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        log("shutting down")
        sched.stop()
        sched.thread.join(timeout=30)  # let the chunk in progress finish: torch must not die mid-op
        server.server_close()
        sys.stdout.flush()
