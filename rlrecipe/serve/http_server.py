"""The HTTP side of `rlrecipe serve`: SGLang's endpoints over the scheduler, and the server's lifecycle."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.sglang.api_key import is_authorized
from rlrecipe.rollout.sglang.versions import LOWEST, NEWEST, Dialect, parse_version
from rlrecipe.serve import routes
from rlrecipe.serve.protocol import (
    BadRequest,
    GenRequest,
    ServerError,
    TooLarge,
    UnknownField,
    build_requests,
    response_body,
)
from rlrecipe.serve.routes import Reply
from rlrecipe.serve.scheduler import JOIN_TIMEOUT_S, Scheduler, log

# An older SGLang version whose rules to follow instead of the newest's (tests of the client
# against both ends of the pin): its version, e.g. 0.5.1, in this environment variable.
RULES_ENV = "RLRECIPE_SERVE_SGLANG"
# A request body larger than this is refused with 413 before any of it is read; a weight push by
# value carries a whole bucket (weight_sync_bucket_mb, 512 MB by default, base64 and once per
# tensor-parallel rank), which SGLang takes whatever its size: that route gets a larger bound.
MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_TENSOR_BODY_BYTES = 8 * 1024 * 1024 * 1024
TENSOR_ROUTES = ("/update_weights_from_tensor", "/load_lora_adapter_from_tensors")


class Handler(BaseHTTPRequestHandler):
    """SGLang's HTTP endpoints over `sched` (what each does: serve/routes.py); make_handler binds a
    scheduler and an API key to it."""

    protocol_version = "HTTP/1.1"  # keep-alive for the engine's sessions
    server_version = "rlrecipe-serve"
    sched: Scheduler
    api_key: str | None = None
    access_log: bool = False  # --access-log: one line per request, as SGLang's (uvicorn's) access log

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass  # by default one line per request would drown the log; the scheduler reports instead

    def log_request(self, code="-", size="-"):
        if self.access_log:  # with who sent it: a run's client names its process in User-Agent
            log(f'{self.client_address[0]}:{self.client_address[1]} - "{self.command} {self.path.split("?")[0]} '
                f'HTTP/1.1" {int(code)} "{self.headers.get("User-Agent", "")}"')

    def _send(self, code: int, body: dict | list | str | bytes | None = None) -> None:
        if body is None:
            data, ctype = b"", "text/plain"
        elif isinstance(body, bytes):  # JSON already encoded
            data, ctype = body, "application/json"
        elif isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, reply: Reply | None) -> None:
        if reply is None:  # the server is going down (the scheduler died): nothing to send
            return
        if reply.close:
            self.close_connection = True
        self._send(reply.code, reply.body)

    def _error(self, code: int, msg: str) -> None:
        self._answer(routes.error(code, msg))

    def _body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("Content-Length must be an integer") from None
        if n < 0:  # read(-1) would wait for the client to close the connection
            raise BadRequest("Content-Length must not be negative")
        limit = MAX_TENSOR_BODY_BYTES if self.path.split("?")[0] in TENSOR_ROUTES else MAX_BODY_BYTES
        if n > limit:
            raise TooLarge(f"request body of {n} bytes; at most {limit}")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _refused(self, path: str) -> bool:
        """401 as SGLang's --api-key middleware: every path but /health... needs the bearer key."""
        if is_authorized(path, self.headers.get("Authorization"), self.api_key):
            return False
        self.close_connection = True  # its body stays unread: the connection cannot carry another
        self._send(401, {"error": "Unauthorized"})
        return True

    def do_GET(self):  # noqa: N802 - stdlib naming
        path = self.path.split("?")[0]
        if self._refused(path):
            return
        self._answer(routes.answer_get(self.sched, path, self._body))

    def do_POST(self):  # noqa: N802 - stdlib naming
        path = self.path.split("?")[0]
        if self._refused(path):
            return
        try:
            body = self._body()
            if path in ("/generate", "/generate/"):
                self._generate(body)
                return
            handler = routes.post_routes(self.sched).get(path)
            if handler is None:
                self._error(404, f"no route POST {path}")
            else:
                self._answer(handler(body))
        except ServerError as err:
            self._error(500, str(err))
        except UnknownField as err:
            self._send(400, {"error": str(err)})  # SGLang's contract gate answers in this shape
        except BadRequest as err:
            self._error(400, str(err))
        except TooLarge as err:
            self._answer(routes.error(413, str(err), close=True))
        except RecursionError:
            self._error(400, "bad request: JSON nested too deeply")
        except (json.JSONDecodeError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                OverflowError) as err:
            self._error(400, f"bad request: {err!r}")

    def do_PUT(self):  # noqa: N802 - SGLang accepts PUT on /generate
        self.do_POST()

    def _generate(self, body: dict) -> None:
        if self.sched.memory.refusal():
            self._error(400, self.sched.memory.refusal() or "")
            return
        reqs, batch = build_requests(body, self.sched)
        if body.get("stream") and (batch or len(reqs) != 1):
            raise BadRequest("stream=true takes one prompt with n = 1 in rlrecipe serve")
        self.sched.submit(reqs)
        if body.get("stream"):
            self._stream(reqs[0])
            return
        for r in reqs:
            r.done.wait()
        outs = [response_body(r, self.sched.tokenizer, self.sched.weight_version) for r in reqs]
        self._send(200, outs if batch else outs[0])

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
                    body = response_body(r, self.sched.tokenizer, self.sched.weight_version)
                    event(b"data: " + json.dumps(body).encode() + b"\n\n")
                if finished:
                    break
            event(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.sched.abort(r.rid)


def make_handler(sched: Scheduler, api_key: str | None = None, access_log: bool = False) -> type[Handler]:
    """The handler class the server instantiates per connection, bound to this scheduler and key."""
    return type("Handler", (Handler,), {"sched": sched, "api_key": api_key, "access_log": access_log})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 4096  # the engine opens hundreds of connections at once (stdlib default: 5)


def make_server(model: str | Path, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32", *,
                chunk_tokens: int = 16, max_batch: int = 256, seed: int = 0,
                join_timeout_s: float = JOIN_TIMEOUT_S, api_key: str | None = None,
                context_length: int | None = None, enable_memory_saver: bool = False,
                kv_cache_dtype: str = "auto", access_log: bool = False, enable_lora: bool = False,
                max_lora_rank: int = 0) -> tuple[Server, Scheduler]:
    from rlrecipe.modeling import DTYPES, load_tokenizer
    from rlrecipe.rollout.fp8_kv import KV_CACHE_DTYPES
    from rlrecipe.rollout.inprocess import InProcessEngine

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype {kv_cache_dtype!r}: the stand-in serves {', '.join(KV_CACHE_DTYPES)}")
    if not (Path(model) / "config.json").exists():
        raise UserError(f"{model}: no model there (an HF directory with config.json)")
    from rlrecipe.checks.model_check import check_model_dir, read_model_config

    read_model_config("model", Path(model))
    check_model_dir("model", model)  # weights, architecture and tokenizer, before anything loads
    t0 = time.time()
    tokenizer = load_tokenizer(model)
    engine = InProcessEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             dtype=dtype, max_batch=max_batch, kv_cache_dtype=kv_cache_dtype)  # unit scales, as SGLang
    context_len = context_length or int(getattr(engine.model.config, "max_position_embeddings", 0) or 1 << 30)
    sched = Scheduler(engine, tokenizer, str(model), context_len, chunk_tokens=chunk_tokens, seed=seed,
                      join_timeout_s=join_timeout_s)
    sched.dtype = dtype  # /server_info's dtype, as SGLang's --dtype
    sched.stated_context_length = context_length  # /server_info's: null unless launched with --context-length
    sched.memory.enabled = enable_memory_saver  # /release_memory_occupation is refused without it
    sched.adapters.enabled, sched.adapters.max_rank = enable_lora, max_lora_rank  # LoRA endpoints, as SGLang's flags
    if os.environ.get(RULES_ENV):
        rules = Dialect(parse_version(os.environ[RULES_ENV]))
        if rules.version is None or not LOWEST <= rules.version <= NEWEST:
            raise UserError(f"{RULES_ENV}={os.environ[RULES_ENV]!r}: expected an SGLang version from "
                            f"{'.'.join(map(str, LOWEST))} to {'.'.join(map(str, NEWEST))}")
        sched.rules = rules
    try:
        server = Server((host, port), make_handler(sched, api_key, access_log))
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    kv = "" if kv_cache_dtype == "auto" else f", KV cache {kv_cache_dtype} with scales 1.0"
    log(f"loaded {model} ({dtype}{kv}, context {context_len}) in {time.time() - t0:.1f}s")
    sched.start()
    return server, sched


def serve_forever(model: str | Path, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32", *,
                  chunk_tokens: int = 16, max_batch: int = 256, seed: int = 0, api_key: str | None = None,
                  context_length: int | None = None, enable_memory_saver: bool = False,
                  kv_cache_dtype: str = "auto", access_log: bool = False, enable_lora: bool = False,
                  max_lora_rank: int = 0) -> None:
    server, sched = make_server(model, host, port, dtype, chunk_tokens=chunk_tokens, max_batch=max_batch, seed=seed,
                                api_key=api_key, context_length=context_length,
                                enable_memory_saver=enable_memory_saver, kv_cache_dtype=kv_cache_dtype,
                                access_log=access_log, enable_lora=enable_lora, max_lora_rank=max_lora_rank)

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
