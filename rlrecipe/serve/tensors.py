"""SGLang's /update_weights_from_tensor body, read as SGLang 0.5.23 reads it on one rank.

The body (sglang/srt/managers/io_struct.py, UpdateWeightsFromTensorReqInput): `serialized_named_tensors`,
one entry per tensor-parallel rank, each a base64 string of a pickled list of (name, tensor);
`load_format` (None: the model's own load_weights), `flush_cache`, `abort_all_requests`,
`weight_version`, `selector`, `torch_empty_cache`. Rank k reads only entry k (tp_worker.py,
deserialize_own_rank), with an unpickler that admits tensor and storage rebuilders and no code
(utils/common.py, SafeUnpickler; torch.storage._load_from_bytes becomes a weights_only torch.load).
This server is one rank, so it reads entry 0, with the same kind of unpickler.

Tensors pickled by value (plain pickle: the bytes travel in the request) are read here, and so are
those pickled by torch's ForkingPickler as shared-memory file names (the push by handle on a CPU,
rollout/weights/handles.py): this server maps the sender's memory and copies from it, as SGLang
does. A file descriptor (torch's default strategy) cannot reach an unrelated process, and a CUDA IPC
handle needs a GPU: both are refused by name.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import pickle

import torch
from torch.multiprocessing import reductions

# the globals a pickled list of named CPU tensors needs, all in SGLang's SafeUnpickler.ALLOWED_GLOBALS
_ALLOWED = {("builtins", "list"), ("builtins", "tuple"), ("collections", "OrderedDict"),
            ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
            ("torch", "Size"), ("torch", "dtype"),
            # shared by file name (SafeUnpickler admits these too)
            ("torch.multiprocessing.reductions", "rebuild_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
            ("torch.storage", "UntypedStorage"), ("torch", "Tensor")}
_REFUSED = {"rebuild_storage_fd": "a file descriptor cannot reach another process: share by file name "
                                  "(torch.multiprocessing's file_system strategy)",
            "rebuild_cuda_tensor": "a CUDA IPC handle needs a GPU, and this server runs on the CPU"}
LOAD_FORMATS = (None, "direct")  # "flattened_bucket" and the quantized formats are not served here


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def _rebuild_from_file(seen: list[str], cls, manager, handle, size, dtype=None):
    seen.append(handle.decode() if isinstance(handle, bytes) else str(handle))
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.shared_files: list[str] = []  # the shared-memory files the tensors were mapped from
        # not a bound method: the memo holds what find_class returns, and a cycle back to the unpickler
        # would keep every mapped file open until a garbage collection
        self._from_file = functools.partial(_rebuild_from_file, self.shared_files)

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return self._from_file
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if name in _REFUSED:
            raise pickle.UnpicklingError(f"{module}.{name}: {_REFUSED[name]}")
        raise pickle.UnpicklingError(f"{module}.{name} is not admitted in serialized_named_tensors (rlrecipe "
                                     "serve reads tensors pickled by value or shared by file name)")


class BadTensors(ValueError):
    pass


def _rank_zero(body: dict) -> tuple[object, list[str]]:
    """What rank 0 unpickles from `serialized_named_tensors`, and the shared-memory files it mapped."""
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads:
        raise BadTensors("serialized_named_tensors must be a non-empty list (one entry per tensor-parallel rank)")
    if body.get("load_format") not in LOAD_FORMATS:
        raise BadTensors(f"load_format {body.get('load_format')!r} is not served by rlrecipe serve")
    if not isinstance(payloads[0], str):
        raise BadTensors("serialized_named_tensors[0] must be a base64 string")
    try:
        unpickler = _Unpickler(io.BytesIO(base64.b64decode(payloads[0], validate=True)))
        return unpickler.load(), unpickler.shared_files
    except (binascii.Error, pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as err:
        raise BadTensors(f"serialized_named_tensors[0]: {err}") from None


def read_adapter_tensors(body: dict) -> dict:
    """Rank 0's adapter from a /load_lora_adapter_from_tensors body: a dict {name: tensor} (the payload
    of /update_weights_from_tensor, a dict where that one is a list); anything else is returned as
    it came, for the load to refuse as SGLang's does."""
    return _rank_zero(body)[0]


def read_named_tensors(body: dict) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Rank 0's (name, tensor) pairs from an /update_weights_from_tensor body, and the shared-memory
    files they were mapped from (none: they came by value)."""
    named, files = _rank_zero(body)
    if not (isinstance(named, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in named)):
        raise BadTensors("serialized_named_tensors[0] must hold a list of (name, tensor) pairs")
    return named, files
