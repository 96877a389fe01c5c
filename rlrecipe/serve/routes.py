"""What `rlrecipe serve`'s endpoints do with the scheduler and what each answers; reading the request
and writing the reply (and /generate, which may stream) are http_server's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from rlrecipe.serve.adapters import TENSOR_PATH
from rlrecipe.serve.memory import Fatal, MemoryRefused
from rlrecipe.serve.protocol import BadRequest, TooLarge, health_probe, max_input_len
from rlrecipe.serve.scheduler import Scheduler, log
from rlrecipe.serve.tensors import BadTensors, read_adapter_tensors

HEALTH_GENERATE_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT: a probe not answered by then is a 503
MEMORY_ROUTES = ("/release_memory_occupation", "/resume_memory_occupation")
ADAPTER_ROUTES = ("/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter")
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")


@dataclass(frozen=True)
class Reply:
    code: int
    body: dict | list | str | bytes | None = None  # bytes: JSON already encoded
    close: bool = False  # the request body stays unread: the connection cannot carry another


def control(result: dict) -> Reply:
    """A control endpoint's {success, message, ...}: HTTP 400 when it did not succeed, as SGLang."""
    return Reply(200 if result["success"] else 400, result)


def error(code: int, msg: str, close: bool = False) -> Reply:
    # SGLang 0.5.23's body for a refused request; an unknown route gets FastAPI's 404 body
    return Reply(code, {"detail": "Not Found"} if code == 404 else {"error": {"message": msg}}, close)


def answer_get(sched: Scheduler, path: str, read_body: Callable[[], dict]) -> Reply | None:
    """The reply to GET `path`; None where the server is going down instead (see `memory`)."""
    if path in ("/health", "/health_generate") and not sched.healthy:
        return Reply(503)  # as SGLang while it warms up or shuts down
    if path == "/health":
        return Reply(200)  # as SGLang: no generation (that is /health_generate)
    if path == "/health_generate":
        return health_generate(sched)
    if path in ("/model_info", "/get_model_info"):
        return Reply(200, {"model_path": sched.model_path, "tokenizer_path": sched.model_path,
                           "served_model_name": sched.model_path, "is_generation": True,
                           "preferred_sampling_params": None, "weight_version": sched.weight_version})
    if path in ("/server_info", "/get_server_info"):
        return Reply(200, {"model_path": sched.model_path, "context_length": sched.stated_context_length,
                           "max_req_input_len": max_input_len(sched.context_len), "tp_size": 1, "dp_size": 1,
                           "version": sched.rules.label(), "frontend": "rlrecipe-serve",
                           "device": "cpu", "dtype": sched.dtype,
                           "kv_cache_dtype": getattr(sched.engine, "kv_cache_dtype", "auto")})
    if path == "/get_weight_version":
        return Reply(200, {"weight_version": sched.weight_version})
    if path == "/flush_cache":
        return Reply(200, FLUSHED)
    if path == "/get_weights_by_name":  # SGLang takes its JSON body on GET as on POST
        return weights_by_name(sched, read_body)
    if path == "/weights_checker" and sched.rules.weights_checksum:
        return weights_checker(sched, read_body())
    if path in MEMORY_ROUTES:  # SGLang routes GET too
        return memory(sched, path, read_body())
    return error(404, f"no route GET {path}")


def post_routes(sched: Scheduler) -> dict[str, Callable[[dict], Reply | None]]:
    """POST path -> handler of the body (all but /generate); the routes an older SGLang lacks only
    under its rules."""
    rules, weights = sched.rules, sched.weights
    routes = {
        "/abort_request": partial(abort, sched),
        "/update_weights_from_disk": partial(update_from_disk, sched),
        "/update_weights_from_tensor": partial(update_from_tensor, sched),
        "/init_weights_update_group": lambda body: control(weights.init_group(body)),
        "/update_weights_from_distributed": lambda body: control(weights.update_weights_from_distributed(body)),
        "/flush_cache": lambda body: Reply(200, FLUSHED),
        "/get_weights_by_name": lambda body: weights_by_name(sched, lambda: body),
    }
    for path in MEMORY_ROUTES:
        routes[path] = partial(memory, sched, path)
    for path in ADAPTER_ROUTES:
        routes[path] = partial(adapter, sched, path)
    if rules.weight_update_session:
        routes["/begin_weight_update"] = lambda body: control(weights.begin_session())
        routes["/end_weight_update"] = lambda body: control(weights.end_session())
    if rules.weights_checksum:
        routes["/weights_checker"] = partial(weights_checker, sched)
    if rules.destroy_group:
        routes["/destroy_weights_update_group"] = lambda body: control(weights.destroy_group(body))
    return routes


def health_generate(sched: Scheduler) -> Reply:
    if sched.memory.refusal():
        return Reply(503)  # nothing it could generate with: memory released, or weights not pushed since
    probe = health_probe()
    sched.submit([probe])
    return Reply(200 if probe.done.wait(HEALTH_GENERATE_S) and probe.finish.get("type") != "abort" else 503)


def weights_by_name(sched: Scheduler, read_body: Callable[[], dict]) -> Reply:
    """SGLang's /get_weights_by_name: {name, truncate_size} -> the parameter's first truncate_size
    rows (dim 0) as float32 nested lists; a name the model lacks is a 400 {"error": {"message"}}."""
    try:
        body = read_body()
        rows = sched.weights.weights_by_name(str(body.get("name", "")), int(body.get("truncate_size", 100)))
    except TooLarge as err:
        return error(413, str(err), close=True)
    except (BadRequest, ValueError, TypeError, OverflowError, RecursionError) as err:  # JSONDecodeError is a ValueError
        return Reply(400, {"error": {"message": f"bad request: {err}"}})
    if rows is None:
        return Reply(400, {"error": {"message": "Get parameter by name failed"}})
    return Reply(200, rows)


def weights_checker(sched: Scheduler, body: dict) -> Reply:
    """SGLang's /weights_checker: action checksum only (snapshot/compare are not served here)."""
    action = body.get("action", "checksum")
    if action != "checksum":
        return Reply(400, {"success": False, "message": f"Unsupported action={action!r} in rlrecipe serve"})
    return Reply(200, sched.weights.checksums())


def memory(sched: Scheduler, path: str, body: dict) -> Reply | None:
    """/release_memory_occupation and /resume_memory_occupation (serve/memory.py): 200 with SGLang's
    body (the endpoint returns nothing: JSON null), 400 {"error": {"message"}} when refused, and
    the process gone (None) where SGLang's scheduler dies."""
    try:
        if path == "/release_memory_occupation":
            sched.memory.release(body, sched.busy())
        else:
            sched.memory.resume(body)
    except MemoryRefused as err:
        return error(400, str(err))
    except Fatal as err:
        sched.die(str(err))
        return None
    log(f"{path.strip('/')} {body.get('tags') or 'all'}")
    return Reply(200, b"null")


def adapter(sched: Scheduler, path: str, body: dict) -> Reply | None:
    """SGLang's LoRA endpoints (serve/adapters.py): 200 or 400 with its body; a tensor payload it
    cannot unpickle ends the server (None), as it ends SGLang's scheduler."""
    adapters, name = sched.adapters, body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string")
    if path == "/unload_lora_adapter":
        sched.wait_unused(name)  # as SGLang: the requests using it finish first
        result = adapters.unload(name)
    elif path == "/load_lora_adapter":
        result = adapters.load_dir(name, str(body.get("lora_path") or ""))
    elif not adapters.enabled:
        result = adapters.load(name, {}, {}, TENSOR_PATH)
    else:
        try:
            tensors = read_adapter_tensors(body)
        except BadTensors as err:
            sched.die(f"load_lora_adapter_from_tensors: {err}")
            return None
        result = adapters.load(name, body.get("config_dict") or {}, tensors, TENSOR_PATH)
    log(f"{path.strip('/')} {name}: {'ok' if result['success'] else result['error_message']}")
    return Reply(200 if result["success"] else 400, result)


def abort(sched: Scheduler, body: dict) -> Reply:
    n = sched.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
    if n:
        log(f"abort {body.get('rid') or 'all'}: {n} request(s)")
    return Reply(200)


def update_from_disk(sched: Scheduler, body: dict) -> Reply:
    if not body.get("model_path"):
        raise BadRequest("model_path is required")
    log(f"update_weights_from_disk {body['model_path']}")
    return control(sched.update_weights(str(body["model_path"]), body.get("weight_version")))


def update_from_tensor(sched: Scheduler, body: dict) -> Reply:
    log(f"update_weights_from_tensor ({len(body.get('serialized_named_tensors') or [])} rank payload(s))")
    return control(sched.weights.update_weights_from_tensor(body))
