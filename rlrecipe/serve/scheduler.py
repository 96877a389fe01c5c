"""The scheduler of `rlrecipe serve`: one thread owns the in-process engine and batches requests onto it.

It gathers the requests that arrive within a few milliseconds of each other and decodes them
together, in chunks of `chunk_tokens` new tokens; between chunks it admits new requests and
applies aborts, so an aborted request returns within one chunk with what it has (finish_reason
abort). Each chunk re-prefills prompt + output so far, the same operation as resuming a partial
rollout; for the small CPU models this serves, that costs little next to the chunk's decoding
steps. A weight update waits until no request runs and holds new ones back meanwhile (as
SGLang's model-update lock does).
"""

from __future__ import annotations

import os
import random
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from rlrecipe.modeling import read_export_for
from rlrecipe.rollout.weights.sync import receive
from rlrecipe.serve.adapters import Adapters
from rlrecipe.serve.memory import FATAL_EXIT, MemoryOccupation
from rlrecipe.serve.protocol import RULES, GenRequest, health_probe
from rlrecipe.serve.weights import JOIN_TIMEOUT_S, ServedWeights, log
from rlrecipe.trajectory.record import SamplingParams, Trajectory

GATHER_S = 0.005


class Scheduler:
    """Owns the engine: batches requests, decodes them in chunks, applies aborts and weight updates."""

    def __init__(self, engine, tokenizer, model_path: str, context_len: int, chunk_tokens: int = 16,
                 seed: int = 0, join_timeout_s: float = JOIN_TIMEOUT_S):
        self.engine = engine
        self.join_timeout_s = join_timeout_s
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.dtype = "auto"  # what /server_info reports (make_server sets the served one)
        self.rules = RULES  # the SGLang version whose rules it follows (make_server may set an older one)
        self.weight_version = "default"
        self.context_len = context_len
        self.stated_context_length: int | None = None  # /server_info's context_length (set by --context-length)
        # ids at or past it would index out of the embedding and fail the whole batch they join
        self.vocab_size = int(engine.model.get_input_embeddings().num_embeddings)
        self.chunk = max(1, chunk_tokens)
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.pending: list[GenRequest] = []
        self.active: list[GenRequest] = []
        self.updates: list[dict] = []
        self.weights_lock = threading.Lock()  # a weight update and a read of the weights (get_weights_by_name)
        self.weights = ServedWeights(self)  # the update group and session, and reads of the served weights
        # LoRA adapters (serve/adapters.py); make_server enables them with --enable-lora
        self.adapters = Adapters(engine.model)
        # released and garbage memory (serve/memory.py); make_server enables it with --enable-memory-saver
        self.memory = MemoryOccupation(engine.model, enabled=False)
        self.stopped = False
        # the server's end on a fatal error (die); a test serving in a thread may raise instead
        self.on_fatal = lambda message: os._exit(FATAL_EXIT)
        # set once a first one-token generation went through (SGLang's warm-up): until then, and
        # once stopped, /health and /health_generate answer 503 as SGLang's do
        self.ready = threading.Event()
        self._turn = 0
        self._tokens = 0
        self._last_report = time.time()
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()
        threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        probe = health_probe("WARMUP")
        self.submit([probe])
        probe.done.wait()
        if probe.finish.get("type") != "abort":
            self.ready.set()
        elif not self.stopped:
            log(f"warm-up generation failed: {probe.finish.get('message')}; /health answers 503")

    @property
    def healthy(self) -> bool:
        """What /health reports: warmed up and not shutting down."""
        return self.ready.is_set() and not self.stopped

    def die(self, message: str) -> None:
        """What SGLang's scheduler does on an error it cannot serve past: the server goes, with a message."""
        log(f"fatal: {message}")
        self.on_fatal(message)

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

    def wait_unused(self, lora: str, timeout: float = 3600.0) -> None:
        """Until no request queued or running names adapter `lora` (SGLang unloads an adapter once
        the requests using it are done)."""
        deadline = time.time() + timeout
        with self.cond:
            while any(r.lora == lora and not r.done.is_set() for r in self.pending + self.active):
                if time.time() > deadline:
                    return
                self.cond.wait(0.05)

    def update_weights(self, model_path: str, weight_version: str | None, timeout: float = 3600.0) -> dict:
        return self._run_update({"model_path": model_path, "weight_version": weight_version}, timeout)

    def run_update(self, job: dict, timeout: float) -> dict:
        """Queue a weight update for the scheduler thread (it waits for running requests) and wait for it."""
        return self._run_update(job, timeout)

    def _run_update(self, job: dict, timeout: float) -> dict:
        if "weights" in self.memory.released:  # SGLang would load into unmapped memory
            return {"success": False, "message": "the weights' memory is released: call "
                                                 "/resume_memory_occupation with tags [\"weights\"] first"}
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
        with self.weights_lock:
            self._load_update(job)
        job["done"].set()

    def busy(self) -> int:
        """Requests queued or running (health probes included) and weight updates waiting."""
        with self.cond:
            return len([r for r in self.pending + self.active if not r.done.is_set()]) + len(self.updates)

    def _load_update(self, job: dict) -> None:
        t0 = time.time()
        try:
            own = self.engine.model.state_dict()
            if "group" in job:  # the trainer broadcasts the tensors as soon as it has sent the request
                tensors = receive(job["group"], job["names"], job["dtypes"], job["shapes"])
                self.engine.update_weights_from_state(dict(tensors), self.engine.version + 1)
                self.memory.written([own[n] for n, _ in tensors])
                source = f"{len(tensors)} broadcast tensors"
            elif "tensors" in job:  # /update_weights_from_tensor: read and checked by the HTTP thread
                self.engine.update_weights_from_state(dict(job["tensors"]), self.engine.version + 1)
                self.memory.written([own[n] for n, _ in job["tensors"]])
                source = f"{len(job['tensors'])} tensors"
            else:
                path = job["model_path"]
                if not (Path(path) / "config.json").exists():
                    raise FileNotFoundError(f"no model at {path}")
                # Read and check every tensor first, copy only then: a file that fails half-way leaves the
                # served weights as they were (SGLang reloads its original weights after a failed load).
                staged = read_export_for(self.engine.model, path)
                self.engine.update_weights_from_state(staged, self.engine.version + 1)
                self.memory.written([own[n] for n in staged if n in own])
                self.model_path = source = path
            if job["weight_version"] is not None:
                self.weight_version = str(job["weight_version"])
            # SGLang's own message for a tensor update: "Success" (weight_updater.py)
            msg = "Success" if "tensors" in job else (f"Succeeded to update model weights from {source} in "
                                                      f"{time.time() - t0:.2f}s.")
            job["result"] = {"success": True, "message": msg, "num_paused_requests": 0}
            if "tensors" in job:  # SGLang's UpdateWeightsFromTensorReqOutput has no num_paused_requests
                del job["result"]["num_paused_requests"]
            log(msg + f" weight_version={self.weight_version}")
        except Exception as err:  # noqa: BLE001 - reported to the client
            job["result"] = {"success": False, "message": f"Failed to update weights: {type(err).__name__}: {err}",
                             "num_paused_requests": 0}
            log(job["result"]["message"])

    def _decode_chunk(self) -> None:
        keys = sorted({r.key for r in self.active}, key=lambda k: min(r.arrived for r in self.active if r.key == k))
        key = keys[self._turn % len(keys)]
        self._turn += 1
        # at most one engine batch per chunk, the rows that have had the fewest chunks first: one request
        # of many samples takes its turns beside the others rather than holding the engine for all of them
        rows = sorted((r for r in self.active if r.key == key), key=lambda r: (r.chunks, r.arrived))
        rows = rows[:max(1, int(getattr(self.engine, "max_batch", len(rows))))]
        for r in rows:
            r.chunks += 1
        steps = min(self.chunk, min(r.max_new_tokens - len(r.output_ids) for r in rows))
        temperature, top_p, top_k, lora = key
        params = SamplingParams(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
                                max_new_tokens=steps, greedy=temperature == 0)
        trajs = [Trajectory(uid=r.rid, prompt_ids=r.input_ids + r.output_ids) for r in rows]
        # with adapters, weights change in place for a chunk or a prompt's log-probs: one at a time
        with (self.weights_lock if self.adapters.enabled else nullcontext()), self.adapters.applied(lora):
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
