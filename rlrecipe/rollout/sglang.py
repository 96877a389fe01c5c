"""SGLang rollout engine: a client of SGLang's native HTTP API, and the servers' lifecycle.

Either it launches `python -m sglang.launch_server` processes itself (one per
`rollout.sglang.num_servers`, on ports base_port + i, logs in `<run_dir>/sglang_server_{i}.log`,
stopped on close, at exit, and on error), or it attaches to running servers (`rollout.urls`).

The API subset used (SGLang 0.4/0.5 `sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, `tokenizer_manager.py`):

- `POST /generate` {input_ids, sampling_params, return_logprob, logprob_start_len, rid} ->
  {text, output_ids, meta_info: {id, finish_reason: {type: stop|length|abort, ...},
  output_token_logprobs: [[logprob, token_id, text|null], ...], ...}}. The token ids and their
  log-probs are read from `output_token_logprobs` (one entry per sampled token); SGLang's
  log-prob is that of the temperature-scaled distribution before top-p/top-k, as in
  `InProcessEngine` (greedy: the raw distribution).
- `POST /abort_request` {rid} or {abort_all}: a running request returns at once with what it
  has, with finish_reason abort. SGLang matches rids by prefix (so rids are fixed-length uuids)
  and, in recent versions, acts on the first abort of a rid only; an abort that lands before the
  scheduler holds the request is lost. So the first round aborts by rid and later rounds, on
  servers this engine launched (nobody else's requests are there), abort all.
- `POST /update_weights_from_disk` {model_path, weight_version} -> {success, message}; the
  server flushes its prefix cache itself. Responses then carry `meta_info.weight_version`, which
  is checked against the version this engine set, so a token is never labelled with a policy
  version that did not produce it.
- `GET /health_generate` (start-up), `GET /model_info` (old name `/get_model_info`: which model an
  attached server has), `GET /server_info` (`context_length`). SGLang refuses (HTTP 400) a
  request whose input + max_new_tokens exceeds the context, so `max_new_tokens` is capped to the
  room left, and a trajectory with no room left is truncated without a request.

C3PO++: with `token_budget`, once the trajectories finished during the call hold that many
response tokens, the requests in flight are aborted and come back partial (status RUNNING);
requests not yet sent are not sent. A later call resumes a partial trajectory by sending
prompt + partial response as `input_ids` with `max_new_tokens` reduced by what it has.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import requests

from rlrecipe.console import console
from rlrecipe.errors import UserError
from rlrecipe.recipe import Recipe, SGLangServer
from rlrecipe.rollout.base import SEED_KEY, RolloutEngine
from rlrecipe.rollout.http_pool import HttpPool, Post, PostFailed
from rlrecipe.trajectory import SamplingParams, Status, Trajectory

LOG_NAME = "sglang_server_{i}.log"
ABORT_RESEND_S = 1.0
# Our stand-in for a -inf log-prob, which SGLang's JSON carries as null.
NEG_INF_LOGP = -999999999.0


# -- server processes ----------------------------------------------------------------------------
def sglang_launch_cmd(model: str, host: str, port: int, index: int, cfg: SGLangServer, dtype: str,
                      seed: int) -> list[str]:
    """`python -m sglang.launch_server ...` for server `index` (its GPUs start at index * tp * dp)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
            "--port", str(port), "--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size),
            "--mem-fraction-static", str(cfg.mem_fraction_static), "--dtype", dtype,
            "--random-seed", str(seed), "--base-gpu-id", str(index * cfg.tp_size * cfg.dp_size),
            *cfg.extra_args]


def _fill(template: Sequence[str], **values) -> list[str]:
    """Substitute the known {placeholders} only (other braces, e.g. in a `-c` script, stay)."""
    out = []
    for part in template:
        for key, value in values.items():
            part = part.replace("{" + key + "}", str(value))
        out.append(part)
    return out


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_LIBC = None


def _pdeathsig_hook():
    """A preexec_fn asking the kernel to SIGTERM the child when this process dies (Linux), or None.

    libc is loaded here, in the parent: the child, forked from a threaded process, only calls it.
    """
    global _LIBC
    if not sys.platform.startswith("linux"):
        return None
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        prctl = _LIBC.prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.stop()


atexit.register(_stop_all_at_exit)


@dataclass(eq=False)
class ServerProcess:
    """One launched server: its own process group, its log file, a clean stop."""

    index: int
    url: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(self.cmd)}\n".encode())
            log.flush()
            in_main = threading.current_thread() is threading.main_thread()
            try:
                self.proc = subprocess.Popen(
                    self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, start_new_session=True,
                    # SGLang stops its own children when it dies; this stops it when we die hard.
                    # (PDEATHSIG follows the forking *thread*, so only from the main thread.)
                    preexec_fn=_pdeathsig_hook() if in_main else None)
            except OSError as err:
                raise UserError(f"cannot start SGLang server {self.index} ({self.cmd[0]}): {err}") from None
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 1) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("=== ")]
        return " | ".join(kept[-lines:])

    def crash_error(self, what: str = "exited") -> UserError:
        last = self.log_tail()
        hint = f"; last log line: {last[:300]!r}" if last else ""
        return UserError(f"SGLang server {self.index} ({self.url}) {what} with code {self.exit_code}{hint}; "
                         f"full log: {self.log_path}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the whole process group, then SIGKILL after `timeout` seconds."""
        proc = self.proc
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the group outlives a dead leader: always signal it
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait_s)
                if sig == signal.SIGTERM:
                    # children the server left behind in its group
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                break
            except subprocess.TimeoutExpired:
                continue
        with _LIVE_LOCK:
            _LIVE.discard(self)


# -- the engine ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Request:
    traj: Trajectory
    server: int
    payload: dict
    rid: str
    post: Post | None = None
    lost: bool = False  # its server was left out before it answered: send it again elsewhere


def sglang_sampling_params(params: SamplingParams, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict:
    """Our SamplingParams as SGLang's `sampling_params` (temperature 0 = greedy, top_k -1 = off)."""
    greedy = params.greedy or params.temperature == 0
    sp = {"max_new_tokens": int(max_new_tokens),
          "temperature": 0.0 if greedy else float(params.temperature),
          "top_p": float(params.top_p),
          "top_k": int(params.top_k) if params.top_k > 0 else -1,
          "ignore_eos": False,
          "skip_special_tokens": False,
          "no_stop_trim": True}
    if stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
    return sp


def _same_model(a: str | Path, b: str | Path) -> bool:
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")


def _model_arg(model_dir: str | Path) -> str:
    """An absolute path when it is a local directory (servers have their own cwd), else as given (hub id)."""
    p = Path(model_dir)
    return str(p.resolve()) if p.exists() else str(model_dir)


class SGLangEngine(RolloutEngine):
    """Rollouts on SGLang servers; every token keeps the server's log-prob and this engine's version."""

    def __init__(self, urls: Sequence[str], *, eos_token_id: int | None = None, version: int = 0,
                 max_concurrency: int = 512, servers: Sequence[ServerProcess] | None = None,
                 stop_token_ids: Sequence[int] | None = None, cfg: SGLangServer | None = None):
        if not urls:
            raise UserError("rollout.urls: no SGLang server to talk to")
        self.urls = [u.rstrip("/") for u in urls]
        self.version = version
        self.eos = eos_token_id
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else (
            [eos_token_id] if eos_token_id is not None else [])
        self.max_concurrency = max_concurrency
        self.servers: list[ServerProcess] = list(servers or [])
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._sessions_lock = threading.Lock()
        # every /generate goes through one asyncio thread, at most max_concurrency open per server
        self._http = HttpPool(len(self.urls), max_concurrency)
        self.cfg = cfg or SGLangServer()
        self.live = list(range(len(self.urls)))  # servers still in use (retry_on_other_servers drops some)
        self._group = None  # the weight update group (weight_sync: distributed), made on first use
        self._regroup = False
        self._failed: set[int] = set()  # servers that died or hung under this engine
        self._server_infos: dict[int, dict] = {}
        self._weight_version: list[str | None] = [None] * len(self.urls)  # None: not set by this engine
        self._closed = False

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe: Recipe, model_dir: str | Path, tokenizer, version: int = 0,
                    run_dir: Path | None = None) -> SGLangEngine:
        ro = recipe.rollout
        eos = tokenizer.eos_token_id
        if ro.urls:
            engine = cls(ro.urls, eos_token_id=eos, version=version, max_concurrency=ro.sglang.max_concurrency,
                         cfg=ro.sglang)
            try:
                engine.wait_healthy(timeout=30.0)
                engine.ensure_model(model_dir, version)
            except BaseException:
                engine.close()
                raise
            return engine
        return cls.launch(model_dir, cfg=ro.sglang, dtype=ro.dtype, run_dir=run_dir, eos_token_id=eos,
                          version=version, seed=recipe.run.seed)

    @classmethod
    def launch(cls, model_dir: str | Path, *, cfg: SGLangServer | None = None, dtype: str = "bfloat16",
               run_dir: str | Path | None = None, eos_token_id: int | None = None, version: int = 0, seed: int = 0,
               launch_cmd: Sequence[str] | Callable[[int, int], list[str]] | None = None,
               env: dict[str, str] | None = None) -> SGLangEngine:
        """Start `cfg.num_servers` servers on base_port + i, wait until they generate, return the engine.

        `launch_cmd` (or `cfg.launch_cmd`) replaces the SGLang command: a list with placeholders
        {model} {host} {port} {index} {dtype} {seed}, or a callable (index, port) -> argv.
        """
        cfg = cfg or SGLangServer()
        template = launch_cmd if launch_cmd is not None else (cfg.launch_cmd or None)
        if template is None and importlib.util.find_spec("sglang") is None:
            raise UserError("rollout.engine=sglang: SGLang is not installed here (GPU machines: "
                            "`make install-gpu`); attach to running servers with rollout.urls, set "
                            "rollout.sglang.launch_cmd, or use rollout.engine=inprocess")
        run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="rlrecipe-sglang-"))
        model = _model_arg(model_dir)
        servers: list[ServerProcess] = []
        try:
            for i in range(cfg.num_servers):
                port = cfg.base_port + i
                if not _port_free(cfg.host, port):
                    raise UserError(f"rollout.sglang.base_port: port {port} on {cfg.host} is already in use "
                                    "(another server still running? pick another base_port, or attach to it "
                                    "with rollout.urls)")
                values = dict(model=model, host=cfg.host, port=port, index=i, dtype=dtype, seed=seed)
                if template is None:
                    cmd = sglang_launch_cmd(model, cfg.host, port, i, cfg, dtype, seed)
                elif callable(template):
                    cmd = list(template(i, port))
                else:
                    cmd = _fill(template, **values)
                host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
                server = ServerProcess(i, f"http://{host}:{port}", cmd, run_dir / LOG_NAME.format(i=i),
                                       env={**os.environ, **(env or {})})
                servers.append(server)
                server.start()
            engine = cls([s.url for s in servers], eos_token_id=eos_token_id, version=version,
                         max_concurrency=cfg.max_concurrency, servers=servers, cfg=cfg)
        except BaseException:
            for s in servers:
                s.stop()
            raise
        try:
            engine.wait_healthy(timeout=cfg.startup_timeout_s)
        except BaseException:
            engine.close()
            raise
        return engine

    # -- plumbing --------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            with self._sessions_lock:
                self._sessions.append(s)
        return s

    def _server(self, i: int) -> ServerProcess | None:
        return self.servers[i] if i < len(self.servers) else None

    def _check_alive(self) -> None:
        for i, s in enumerate(self.servers):
            if i in self.live and s.proc is not None and not s.alive():
                self._leave_out(i, s.crash_error())

    def read_timeout(self, max_new_tokens: int) -> float:
        """Seconds a /generate for this many new tokens may go without an answer."""
        return self.cfg.request_timeout_s + self.cfg.request_timeout_per_token_s * max_new_tokens

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
                      "and it is left out from now on")
        if self._group is not None:
            self._regroup = True  # the weight update group still counts it: rebuild before the next update

    def _down_error(self, i: int, err: Exception, what: str, may_exit: bool = True) -> UserError:
        server = self._server(i)
        if server is not None:
            # the socket closes a moment before the process can be reaped (a hung one will not exit)
            deadline = time.monotonic() + (3.0 if may_exit else 0.0)
            while server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not server.alive():
                return server.crash_error()
            return UserError(f"SGLang server {i} ({self.urls[i]}) {what}: {err}; log: {server.log_path}")
        return UserError(f"SGLang server {self.urls[i]} {what}: {err} (is it running? rollout.urls)")

    def _post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> requests.Response:
        try:
            return self._session().post(self.urls[i] + path, json=body, timeout=timeout)
        except requests.RequestException as err:
            raise self._down_error(i, err, f"unreachable on {path}") from None

    def wait_healthy(self, timeout: float) -> None:
        """Until every server answers /health_generate with 200; fail early when a launched one exits."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.urls)))
        last_err: dict[int, str] = {}
        while pending:
            for i in sorted(pending):
                server = self._server(i)
                if server is not None and server.proc is not None and not server.alive():
                    raise server.crash_error("exited during start-up")
                try:
                    r = self._session().get(self.urls[i] + "/health_generate", timeout=30)
                    if r.status_code == 200:
                        pending.discard(i)
                        continue
                    last_err[i] = f"HTTP {r.status_code}"
                except requests.RequestException as err:
                    last_err[i] = type(err).__name__
            if not pending:
                break
            if time.monotonic() > deadline:
                i = min(pending)
                server = self._server(i)
                where = f"; log: {server.log_path}" if server is not None else ""
                raise UserError(f"SGLang server {self.urls[i]} not healthy after {timeout:.0f}s "
                                f"(last: {last_err.get(i, '?')}; raise rollout.sglang.startup_timeout_s?){where}")
            time.sleep(0.25)

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
        info = self.server_info(i)
        ctx = info.get("context_length")
        if not isinstance(ctx, int) and isinstance(info.get("max_req_input_len"), int):
            ctx = info["max_req_input_len"] + 1
        return ctx if isinstance(ctx, int) and ctx > 0 else None

    def ensure_model(self, model_dir: str | Path, version: int) -> None:
        """Attached servers must serve `model_dir`: reload it where /get_model_info says otherwise."""
        for i in range(len(self.urls)):
            try:
                current = self.model_info(i).get("model_path")
            except (requests.RequestException, ValueError) as err:
                raise self._down_error(i, err, "did not answer /model_info") from None
            if current is None or not _same_model(current, model_dir):
                self._update_one(i, _model_arg(model_dir), version)

    # -- generation ------------------------------------------------------------------------------
    def _submit(self, req: _Request) -> Future:
        max_new = req.payload["sampling_params"]["max_new_tokens"]
        req.post = Post(req.server, self.urls[req.server] + "/generate", req.payload, self.read_timeout(max_new))
        return self._http.submit(req.post)

    def _answer(self, req: _Request, fut: Future) -> dict | None:
        """The server's JSON for a finished request; None when it went unsent or must go elsewhere."""
        try:
            result = fut.result()
        except PostFailed as err:
            if req.server in self._failed and self.cfg.retry_on_other_servers:
                req.lost = True  # its server was reported and left out already
                return None
            if err.timed_out:
                what = (f"did not answer /generate within {req.post.read_timeout_s:.0f} s (hung? the limit is "
                        "rollout.sglang.request_timeout_s + request_timeout_per_token_s x max_new_tokens)")
            else:
                what = "failed during /generate"
            self._leave_out(req.server, self._down_error(req.server, err, what, may_exit=not err.timed_out))
            req.lost = True
            return None
        if result is None:
            return None
        status, text = result
        if status != 200:
            raise UserError(f"SGLang server {self.urls[req.server]} /generate: HTTP {status}: {text[:500]}")
        return json.loads(text)

    def _abort(self, reqs: Sequence[_Request], all_on_own_servers: bool = False) -> None:
        """Abort these requests by rid; with `all_on_own_servers`, servers this engine launched
        abort everything instead (SGLang acts on a rid's first abort only, and may miss it)."""
        bodies: list[tuple[int, dict]] = []
        for server in sorted({r.server for r in reqs} - self._failed):
            if all_on_own_servers and self._server(server) is not None:
                bodies.append((server, {"abort_all": True}))
            else:
                bodies += [(server, {"rid": r.rid}) for r in reqs if r.server == server]
        failed: set[int] = set()
        for server, body in bodies:
            if server in failed:
                continue  # one unanswered abort is enough: don't wait on it once per request
            try:
                self._session().post(self.urls[server] + "/abort_request", json=body, timeout=10)
            except requests.RequestException:
                failed.add(server)  # the /generate call reports a dead server

    def _apply(self, t: Trajectory, out: dict, params: SamplingParams, version: int, server: int) -> None:
        meta = out.get("meta_info") or {}
        expected, got = self._weight_version[server], meta.get("weight_version")
        if expected is not None and got is not None and str(got) != expected:
            raise UserError(f"SGLang server {self.urls[server]} answered with weight_version {got!r}, but this "
                            f"engine last set {expected!r}: someone else updated its weights (rollout.urls "
                            "servers must serve this run only)")
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        lps = meta.get("output_token_logprobs")
        if lps is None:
            if kind != "abort" and out.get("output_ids"):
                raise UserError(f"SGLang /generate returned no meta_info.output_token_logprobs (rid {meta.get('id')}); "
                                "the server must support return_logprob")
            lps = []
        for entry in lps:
            logp, token = entry[0], entry[1]
            t.append(int(token), NEG_INF_LOGP if logp is None else float(logp), version)
        if kind == "stop":
            t.status = Status.FINISHED
        elif kind == "length":
            t.status = Status.TRUNCATED
            if len(t.response_ids) < params.max_new_tokens:  # the server's context length ended it
                t.meta["truncated_by_server"] = True
        else:  # abort (ours, or the server's) or nothing: partial, resumable
            t.status = Status.RUNNING
            if len(t.response_ids) >= params.max_new_tokens:
                t.status = Status.TRUNCATED

    def generate(self, trajs: list[Trajectory], params: SamplingParams, *,
                 token_budget: int | None = None, seed: int | None = None) -> list[Trajectory]:
        # `seed` is not sent: SGLang draws from its own --random-seed stream.
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        self._check_alive()
        todo = [t for t in trajs if not t.done and t.status != Status.ABORTED]
        for t in todo:
            t.status = Status.RUNNING
            if len(t.response_ids) >= params.max_new_tokens:
                t.status = Status.TRUNCATED
        todo = [t for t in todo if t.status == Status.RUNNING]
        if not todo:
            return trajs
        version = self.version
        # a group's samples go to one server, which then shares their prompt's prefix cache
        groups: dict[str, int] = {}
        reqs: list[_Request] = []
        for t in todo:
            server = self.live[groups.setdefault(t.group_id or t.uid, len(groups)) % len(self.live)]
            input_ids = list(t.prompt_ids) + list(t.response_ids)
            max_new = params.max_new_tokens - len(t.response_ids)
            ctx = self.context_len(server)
            if ctx is not None:
                max_new = min(max_new, ctx - len(input_ids))
                if max_new <= 0:  # the context is full: it can never finish
                    t.status = Status.TRUNCATED
                    t.meta["truncated_by_server"] = True
                    continue
            rid = uuid.uuid4().hex  # fixed length: SGLang matches abort rids by prefix
            sp = sglang_sampling_params(params, max_new, self.stop_token_ids)
            if SEED_KEY in t.meta:  # honoured by SGLang >= 0.5.3 (exactly so with --enable-deterministic-inference)
                sp["sampling_seed"] = int(t.meta[SEED_KEY])
            payload = {"input_ids": input_ids, "sampling_params": sp,
                       "return_logprob": True, "logprob_start_len": -1, "rid": rid, "stream": False}
            reqs.append(_Request(t, server, payload, rid))
        futures: dict[Future, _Request] = {self._submit(r): r for r in reqs}
        pending = set(futures)
        finished_tokens = 0
        stopping = False
        last_abort, abort_rounds = 0.0, 0
        try:
            while pending:
                done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    req = futures.pop(fut)
                    out = self._answer(req, fut)
                    if out is not None:
                        self._apply(req.traj, out, params, version, req.server)
                        if req.traj.done:
                            finished_tokens += len(req.traj.response_ids)
                    elif req.lost and not stopping:
                        # its server was left out: the same request, from the start, on another
                        req.server = self.live[hash(req.rid) % len(self.live)]
                        req.payload = {**req.payload, "rid": uuid.uuid4().hex}
                        req.rid, req.lost = req.payload["rid"], False
                        new = self._submit(req)
                        futures[new] = req
                        pending.add(new)
                if not stopping and token_budget is not None and finished_tokens >= token_budget:
                    stopping = True
                    # not sent yet: withdrawn, the trajectory stays as it is
                    pending = {f for f in pending if not self._http.withdraw(futures[f].post)}
                if stopping and pending and time.monotonic() - last_abort > ABORT_RESEND_S:
                    self._abort([futures[f] for f in pending if futures[f].post.sent],
                                all_on_own_servers=abort_rounds > 0)
                    last_abort, abort_rounds = time.monotonic(), abort_rounds + 1
                self._check_alive()
        except BaseException:
            sent = [futures[f] for f in pending if not self._http.withdraw(futures[f].post) and not f.done()]
            self._abort([r for r in sent if r.server in self.live])
            raise
        return trajs

    # -- weights ---------------------------------------------------------------------------------
    def _update_one(self, i: int, model_path: str, version: int) -> None:
        self._call(i, "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}, 3600.0)
        self._weight_version[i] = str(version)  # the update flushed the server's prefix cache too

    def update_weights_from_disk(self, model_dir: str | Path, version: int) -> None:
        self._check_alive()
        model_path = _model_arg(model_dir)
        if len(self.live) == 1:
            self._update_one(self.live[0], model_path, version)
        else:
            with ThreadPoolExecutor(max_workers=min(len(self.live), 32)) as pool:
                for fut in [pool.submit(self._update_one, i, model_path, version) for i in self.live]:
                    fut.result()
        self.version = version

    def _call(self, i: int, path: str, body: dict, read_timeout: float) -> None:
        """POST a control request that answers {success, message}; raise unless it succeeded."""
        r = self._post(i, path, body, timeout=(30.0, read_timeout))
        try:
            body = r.json()
        except ValueError:
            body = {"success": False, "message": r.text[:500]}
        if r.status_code != 200 or not body.get("success", False):
            raise UserError(f"SGLang server {self.urls[i]} {path} failed: {body.get('message', f'HTTP {r.status_code}')}")

    # weight_sync (and torch) are imported where the broadcast path needs them: the HTTP client
    # itself stays free of torch.
    def _init_group(self) -> None:
        """Make the weight update group: this process is rank 0, then each server's tp ranks."""
        from rlrecipe.rollout.weight_sync import DEFAULT_GROUP, init_custom_group, run_beside

        cfg = self.cfg
        sizes = []
        for i in self.live:
            info = self.server_info(i)
            if int(info.get("dp_size", 1) or 1) != 1:
                raise UserError(f"rollout.sglang.weight_sync: distributed needs dp_size 1 per server "
                                f"({self.urls[i]} has {info['dp_size']}); run more servers instead")
            sizes.append(int(info.get("tp_size", cfg.tp_size) or cfg.tp_size))
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        bodies = [{"master_address": cfg.weight_sync_address, "master_port": cfg.weight_sync_port,
                   "rank_offset": offsets[k], "world_size": world, "group_name": DEFAULT_GROUP,
                   "backend": cfg.weight_sync_backend} for k in range(len(self.live))]
        group = []
        run_beside([lambda i=i, k=k: self._call(i, "/init_weights_update_group", bodies[k], 900.0)
                    for k, i in enumerate(self.live)],
                   lambda: group.append(init_custom_group(cfg.weight_sync_backend, cfg.weight_sync_address,
                                                          cfg.weight_sync_port, 0, world, DEFAULT_GROUP)))
        self._group = group[0]

    def update_weights_from_state(self, state_dict: dict, version: int) -> None:
        """Broadcast the weights into the servers (weight_sync: distributed); nothing touches disk."""
        from rlrecipe.rollout.weight_sync import buckets, distinct_tensors

        if self.cfg.weight_sync != "distributed":
            raise NotImplementedError("SGLangEngine takes weights from disk unless rollout.sglang.weight_sync "
                                      "is distributed")
        self._check_alive()
        if self._regroup:
            self._drop_group()
            self._regroup = False
        if self._group is None:
            self._init_group()
        device = "cuda" if self.cfg.weight_sync_backend == "nccl" else "cpu"
        chunks = list(buckets(distinct_tensors(state_dict), self.cfg.weight_sync_bucket_mb << 20))
        try:
            self._broadcast_chunks(chunks, version, device)
        except BaseException:
            self._drop_group()  # a broadcast nobody received would desynchronise every later one
            raise
        for i in self.live:
            self._weight_version[i] = str(version)
        self.version = version

    def _broadcast_chunks(self, chunks: list, version: int, device: str) -> None:
        from rlrecipe.rollout.weight_sync import DEFAULT_GROUP, broadcast, dtype_name, run_beside

        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            tensors = [t.detach().to(device).contiguous() for _, t in chunk]
            body = {"names": [n for n, _ in chunk], "dtypes": [dtype_name(t.dtype) for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": DEFAULT_GROUP, "flush_cache": last}
            if last:
                body["weight_version"] = str(version)
            run_beside([lambda i=i, body=body: self._call(i, "/update_weights_from_distributed", body, 3600.0)
                        for i in self.live],
                       lambda tensors=tensors: broadcast(self._group, tensors))

    def _drop_group(self) -> None:
        """Leave the weight update group on both sides (servers that are gone left it already)."""
        if self._group is None:
            return
        import torch.distributed as dist

        from rlrecipe.rollout.weight_sync import DEFAULT_GROUP

        for i in self.live:
            try:
                self._post(i, "/destroy_weights_update_group", {"group_name": DEFAULT_GROUP}, timeout=10)
            except UserError:
                pass
        dist.destroy_process_group(self._group)
        self._group = None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_group()
        self._http.close()
        for server in self.servers:
            server.stop()
        with self._sessions_lock:
            for s in self._sessions:
                s.close()
            self._sessions.clear()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
