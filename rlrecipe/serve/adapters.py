"""LoRA adapters in `rlrecipe serve` (--enable-lora), answered as SGLang 0.5.23 answers (tried on a
CPU, docs/sglang-cpu.md; the client's side is rollout/sglang/lora.py).

An adapter is kept as its weight deltas, (alpha / r) B A per adapted linear layer (SGLang's scaling:
it ignores use_rslora), and applied by adding them into the served weights for the chunk or
prompt that names it, the weights copied back after (the base never drifts by rounding). SGLang
computes x W + scaling (x A) B instead: the two agree to float rounding.

Bodies: load and unload answer {rid, http_worker_ipc, success, error_message, loaded_adapters
{name: path or "__tensor__"}}, 200 on success, else 400 (loaded_adapters null where SGLang's
tokenizer manager refused before its workers saw the request). A /generate naming an adapter never
loaded is a 400 {"error": {"message"}}; one loaded from disk and unloaded since is loaded again
from its path, as SGLang does; one from tensors cannot be.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

TENSOR_PATH = "__tensor__"  # SGLang's lora_path for an adapter loaded from tensors
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class AdapterRefused(Exception):
    """A /generate naming an adapter this server cannot apply: 400 {"error": {"message"}}."""


class Adapters:
    """The adapters one server holds, by name; `enabled` and `max_rank` from --enable-lora and
    --max-lora-rank."""

    def __init__(self, model: torch.nn.Module, enabled: bool = False, max_rank: int = 0):
        self.model, self.enabled, self.max_rank = model, enabled, max_rank
        self.deltas: dict[str, dict[str, torch.Tensor]] = {}  # name -> {served parameter: delta}
        self.paths: dict[str, str] = {}  # name -> its path, or TENSOR_PATH (kept after an unload, as SGLang)
        self.order: list[str] = []  # loaded, in load order (SGLang's loaded_adapters)
        self.lock = threading.Lock()

    def _result(self, success: bool, error: str = "", listed: bool = True) -> dict:
        loaded = {n: self.paths[n] for n in self.order} if listed else None
        return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error,
                "loaded_adapters": loaded}

    def load(self, name: str, config: dict, tensors: dict[str, torch.Tensor], path: str) -> dict:
        """Adapter `name` from PEFT's config and tensors (`path`: its directory, or TENSOR_PATH)."""
        if not self.enabled:
            return self._result(False, NOT_ENABLED, listed=False)
        with self.lock:
            if name in self.order:
                return self._result(False, f"Failed to load LoRA adapter {name} because it is already loaded")
            try:
                rank, alpha = int(config["r"]), float(config["lora_alpha"])
                if rank > self.max_rank:
                    return self._result(False, f"LoRA adapter {name} with rank {rank} is incompatible with the "
                                               "current LoRA memory pool configuration. Please ensure that the LoRA "
                                               "adapter's rank is within the configured `--max-lora-rank` and that "
                                               "the target modules are included in `--lora-target-modules`.")
                deltas = self._deltas(tensors, alpha / rank)
            except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
                return self._result(False, str(err))
            self.deltas[name], self.paths[name] = deltas, path
            self.order.append(name)
            return self._result(True)

    def load_dir(self, name: str, path: str) -> dict:
        """Adapter `name` from a PEFT directory (adapter_config.json, adapter_model.safetensors)."""
        if not self.enabled:
            return self._result(False, NOT_ENABLED, listed=False)
        from safetensors.torch import load_file

        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except (OSError, ValueError) as err:
            return self._result(False, f"cannot read the adapter at {path}: {err}")
        return self.load(name, config, tensors, str(path))

    def unload(self, name: str) -> dict:
        if not self.enabled:
            return self._result(False, NOT_ENABLED, listed=False)
        with self.lock:
            if name not in self.order:
                return self._result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                           f"odict_keys({self.order!r})", listed=False)
            self.order.remove(name)
            del self.deltas[name]
            return self._result(True)

    def _deltas(self, tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
        """(scaling) B A for each adapted layer, under the served parameter's name and dtype."""
        params = dict(self.model.named_parameters())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            for part in ("lora_A", "lora_B"):
                if f".{part}." in key:
                    module = key.split(f".{part}.")[0].removeprefix("base_model.model.")
                    pairs.setdefault(module, {})[part] = t
        out = {}
        for module, ab in pairs.items():
            weight = params.get(f"{module}.weight")
            if weight is None or set(ab) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter tensors for {module}: no such linear layer in the served model, or A "
                                 "or B missing")
            delta = scaling * (ab["lora_B"].double() @ ab["lora_A"].double())
            if tuple(delta.shape) != tuple(weight.shape):
                raise ValueError(f"adapter of {module}: delta {list(delta.shape)} for a weight {list(weight.shape)}")
            out[f"{module}.weight"] = delta.to(weight.dtype)
        return out

    def check(self, name: str | None) -> None:
        """Raise AdapterRefused unless `name` can be applied; an adapter once loaded from disk and
        unloaded since is loaded again from its path first, as SGLang does."""
        if not name:
            return
        if not self.enabled:
            raise AdapterRefused(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
                                 "server with --enable-lora flag and preload adapters using --lora-paths or "
                                 "/load_lora_adapter endpoint.")
        if name in self.order:
            return
        if name not in self.paths:
            raise AdapterRefused(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: "
                                 f"dict_keys({list(self.paths)!r}).")
        if self.paths[name] == TENSOR_PATH:
            raise AdapterRefused(f"Failed to implicitly load LoRA adapter {name}: it was loaded from tensors and "
                                 "unloaded since; nothing to load it again from")
        result = self.load_dir(name, self.paths[name])
        if not result["success"] and "already loaded" not in result["error_message"]:
            raise AdapterRefused(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")

    @contextmanager
    def applied(self, name: str | None):
        """The served weights with adapter `name` added for the block (none: as they are); the caller
        holds the weights lock, so nothing else reads or writes them meanwhile."""
        with self.lock:
            deltas = self.deltas.get(name) if name else None
        if not deltas:
            yield
            return
        params = dict(self.model.named_parameters())
        saved = {n: params[n].detach().clone() for n in deltas}
        try:
            with torch.no_grad():
                for n, d in deltas.items():
                    params[n].add_(d)
            yield
        finally:
            with torch.no_grad():
                for n, w in saved.items():
                    params[n].copy_(w)
