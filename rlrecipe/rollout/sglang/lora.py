"""LoRA adapters into SGLang servers (trainer.lora): the base weights never move, each push loads
the adapter under a new name, and every /generate names the current one (`lora_path`).

SGLang 0.5.23 (entrypoints/http_server.py, managers/io_struct.py, lora/lora_manager.py; tried on a
CPU, docs/sglang-cpu.md):

- `/load_lora_adapter_from_tensors` {lora_name, config_dict (PEFT's adapter_config.json),
  serialized_named_tensors: one base64 pickle per tensor-parallel rank, each a dict
  {PEFT name: tensor}, read by SafeUnpickler as /update_weights_from_tensor's}; or
  `/load_lora_adapter` {lora_name, lora_path: a PEFT directory}. 200 {success: true, error_message:
  "", loaded_adapters: {name: path or "__tensor__"}}; 400 {success: false, error_message} for a name
  already loaded, a rank above --max-lora-rank, a server without --enable-lora. A payload it
  cannot unpickle kills the server.
- `/unload_lora_adapter` {lora_name}: 200 as above; 400 "LoRA with name X does not exist". It
  waits for the requests still using the adapter, so an adapter is unloaded one push after it was
  replaced, when none names it any more, and never by a run that did not load it.
- `/generate` with `lora_path` naming an adapter never loaded: 400 {"error": {"message"}}. A name
  once loaded from disk and since unloaded is loaded again from its path, silently.

The server needs `--enable-lora --max-lora-rank R --lora-target-modules ...` at launch
(`launch_args`); --max-loras-per-batch 2 lets the old and the new adapter sit side by side while
one replaces the other.
"""

from __future__ import annotations

import base64
import pickle
import secrets
from typing import Any, Protocol

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import LoraSection, SGLangServer
from rlrecipe.rollout.sglang.session import answer
from rlrecipe.rollout.weights.adapter import Adapter

LOAD_S = 600.0  # a load reads (or unpickles) the adapter and copies it: small next to a model
MAX_LORAS_PER_BATCH = 2
PLACEHOLDER = "{lora_args}"  # a launch_cmd argument that stands for launch_args (none without trainer.lora)
ALREADY_LOADED, NOT_LOADED = "already loaded", "does not exist"


class AdapterServers(Protocol):
    cfg: SGLangServer
    urls: list[str]

    def post(self, i: int, path: str, body: dict, timeout: float | tuple | None = 30.0) -> Any: ...

    def server_info(self, i: int) -> dict: ...


def adapter_prefix() -> str:
    """Drawn once per fleet: adapter names of another run on the same servers never match this one's."""
    return f"policy-{secrets.token_hex(4)}"


def adapter_name(prefix: str, version: int) -> str:
    return f"{prefix}-v{version}"


def launch_args(section: LoraSection | None) -> list[str]:
    """SGLang's launch flags for the recipe's trainer.lora; none when it is off. "all-linear" is
    SGLang's "all" (every module it can adapt; the adapter's config says which it does)."""
    if section is None or not section.enabled:
        return []
    targets = ["all"] if section.target_modules == "all-linear" else list(section.target_modules)
    return ["--enable-lora", "--max-lora-rank", str(section.rank), "--max-loras-per-batch",
            str(MAX_LORAS_PER_BATCH), "--lora-target-modules", *targets]


def serialize_adapter(tensors: dict) -> str:
    """One rank's payload: base64 of the pickled dict {name: tensor}, copies on the CPU (by value)."""
    fresh = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    return base64.b64encode(pickle.dumps(fresh, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def _message(r: Any) -> str:
    body = answer(r)
    err = body.get("error")
    return str(body.get("error_message") or (err.get("message") if isinstance(err, dict) else err)
               or body.get("message") or f"HTTP {r.status_code}")


def load(srv: AdapterServers, i: int, name: str, adapter: Adapter, tp: int = 1) -> None:
    """Server i loads `adapter` as `name`: from its directory where it was written, else by value.
    A name left loaded (a server attached again after a run that stopped) is unloaded first, once."""
    if adapter.path is not None:
        path, body = "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter.path)}
    else:
        path = "/load_lora_adapter_from_tensors"
        body = {"lora_name": name, "config_dict": adapter.config,
                "serialized_named_tensors": [serialize_adapter(adapter.tensors)] * tp}
    r = srv.post(i, path, body, timeout=(30.0, LOAD_S))
    if r.status_code == 400 and ALREADY_LOADED in _message(r):
        unload(srv, i, name)
        r = srv.post(i, path, body, timeout=(30.0, LOAD_S))
    if r.status_code != 200 or not answer(r).get("success", False):
        msg = _message(r)
        hint = (" (launched servers get --enable-lora from trainer.lora; a launch_cmd takes them as the argument "
                f"\"{PLACEHOLDER}\", and an attached server must be started with them)" if "--enable-lora" in msg else "")
        raise UserError(f"SGLang server {srv.urls[i]} {path} {name} failed: {msg}{hint}")


def unload(srv: AdapterServers, i: int, name: str) -> None:
    """Server i drops adapter `name`; one it does not hold (restarted since) is not an error."""
    r = srv.post(i, "/unload_lora_adapter", {"lora_name": name}, timeout=(30.0, LOAD_S))
    if r.status_code != 200 and NOT_LOADED not in _message(r):
        raise UserError(f"SGLang server {srv.urls[i]} /unload_lora_adapter {name} failed: {_message(r)}")
