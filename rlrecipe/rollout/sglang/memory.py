"""Memory a colocated SGLang fleet gives up while the trainer trains, and takes back.

`/release_memory_occupation {"tags": [...]}` frees the servers' KV cache, weights and CUDA graphs
(tags `kv_cache`, `weights`, `cuda_graph`); `/resume_memory_occupation` allocates them again. It
needs servers launched with `--enable-memory-saver` (otherwise SGLang answers 200 and frees
nothing); released weights are discarded, not kept: after a resume of `weights` the servers hold
garbage until the next push lands. SGLang asserts it is idle at a release (a request in flight
kills the server), and a resume of a tag not released kills it too, so the order is the caller's
to keep: generate, release all, train, resume weights, push, flush, resume kv_cache, verify.

Both answer JSON null with 200; a refusal is {"error": {"message"}} with 400
(sglang/srt/entrypoints/http_server.py, _create_error_response).
"""

from __future__ import annotations

from typing import Any, Protocol

from rlrecipe.core.errors import UserError

# sglang/srt/constants.py GPU_MEMORY_ALL_TYPES. A tag a server's version does not know is kept and
# ignored by SGLang's release (weight_updater.py), so all three are sent to every version of the pin.
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"
MEMORY_S = 600.0  # a release or resume waits for the server's ranks and the allocator, not a load


class MemoryServers(Protocol):
    urls: list[str]
    live: list[int]

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...


def _message(r: Any) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:300] or f"HTTP {r.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        return str(err.get("message") if isinstance(err, dict) else body.get("message") or body)[:300]
    return str(body)[:300]


def check_tags(tags: tuple[str, ...] | list[str]) -> list[str]:
    tags = list(tags)
    unknown = [t for t in tags if t not in ALL_TAGS]
    if not tags or unknown:
        raise ValueError(f"memory tags: {unknown or tags!r}; expected some of {', '.join(ALL_TAGS)}")
    return tags


def flush(srv: MemoryServers) -> None:
    """POST /flush_cache to every live server; an error naming the first that did not flush."""
    for i in list(srv.live):
        r = srv.post(i, "/flush_cache", {}, timeout=(30.0, MEMORY_S))
        if r.status_code != 200:
            raise UserError(f"SGLang server {srv.urls[i]} /flush_cache failed: HTTP {r.status_code}: {_message(r)}")


def occupy(srv: MemoryServers, path: str, tags: list[str]) -> None:
    """POST `path` with `tags` to every live server; an error naming the first that refused."""
    for i in list(srv.live):
        r = srv.post(i, path, {"tags": tags}, timeout=(30.0, MEMORY_S))
        if r.status_code != 200:
            hint = (" (launched with --enable-memory-saver? rollout.colocate adds it to launched servers; a "
                    "launch_cmd or an attached server must carry it)" if path == RELEASE else "")
            raise UserError(f"SGLang server {srv.urls[i]} {path} {tags} failed: HTTP {r.status_code}: "
                            f"{_message(r)}{hint}")
