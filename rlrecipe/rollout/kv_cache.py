"""The in-process engine's KV cache: transformers' DynamicCache with room to grow.

DynamicCache appends each decoding step's keys and values with `torch.cat`, which copies the
whole cache, every layer, every step; at the sizes C3PO++ decodes on CPU that copy cost more
than the attention itself (docs/performance.md has the measurements).
Here each layer keeps its keys and values in a buffer with spare columns: a step writes one
column, and the buffer is copied only when it fills (a quarter of its length is added each time)
or when the engine has replaced the tensors itself (joining, compacting, re-laying a packed
prefill), which it does between steps, not within them. `keys`/`values` stay what transformers
and the engine expect: [rows, heads, length, head_dim] tensors, here views into the buffer.

With an FP8 cache (rollout.kv_cache_dtype, rollout/fp8_kv.py) the buffers hold FP8: each write is
quantized with its layer's scale, and `update` hands attention the whole cache dequantized, except
to a prefill (nothing cached before the call), which attends its own keys and values at full
precision as SGLang's extend kernels do; decoding then reads every token, its own included, from
FP8, as SGLang's decode kernels do. `keys`/`values` are then the FP8 tensors, so the engine's
joins, selections and re-layouts move FP8 bytes. What attention reads is a dequantized copy of the
buffers, kept beside them: a step dequantizes only the columns it wrote, a remade buffer all of
them (the same values as dequantizing on every read, without its cost). On CPU this models the
numerics of an FP8 cache, not its speed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from rlrecipe.rollout.fp8_kv import KVQuant, dequantize, quantize

MIN_ROOM = 32  # spare columns added at the least when a buffer is (re)made


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `update` writes into spare room instead of concatenating."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._view: torch.Tensor | None = None  # the keys view last handed out; anything else was replaced
        self._room = 0
        self.fp8: tuple[torch.dtype, float, float] | None = None  # (format, k_scale, v_scale): an FP8 cache
        self._deq: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 cache: its buffers dequantized

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.dim() == 4 else 0  # lazy_initialization leaves an empty 1-d tensor
        if self.fp8 is None:
            return self._write(old, key_states, value_states)
        fmt, k_scale, v_scale = self.fp8
        new = old + key_states.shape[-2]
        rebuilt = self.keys is not self._view or new > self._room
        k8, v8 = quantize(key_states, k_scale, fmt), quantize(value_states, v_scale, fmt)
        keys, values = self._write(old, k8, v8)
        dtype = key_states.dtype
        if rebuilt:  # the buffers were remade: dequantize what they hold once
            self._deq = (dequantize(self._key_buffer, k_scale, dtype), dequantize(self._value_buffer, v_scale, dtype))
        else:  # only the new columns: a step dequantizes what it wrote, not the whole cache
            self._deq[0][:, :, old:new] = dequantize(k8, k_scale, dtype)
            self._deq[1][:, :, old:new] = dequantize(v8, v_scale, dtype)
        if not old:  # a prefill attends its own tokens before they are stored
            return key_states, value_states
        return self._deq[0][:, :, :new], self._deq[1][:, :, :new]

    def _write(self, old: int, key_states: torch.Tensor, value_states: torch.Tensor):
        new = old + key_states.shape[-2]
        if self.keys is not self._view or new > self._room:
            self._rebuffer(old, new, key_states)
        self._key_buffer[:, :, old:new].copy_(key_states)
        self._value_buffer[:, :, old:new].copy_(value_states)
        self.keys, self.values = self._key_buffer[:, :, :new], self._value_buffer[:, :, :new]
        self._view = self.keys
        return self.keys, self.values

    def _rebuffer(self, old: int, new: int, like: torch.Tensor) -> None:
        room = new + max(MIN_ROOM, new // 4)
        rows, heads, _, dim = like.shape
        keys = like.new_empty((rows, heads, room, dim))
        values = like.new_empty((rows, heads, room, dim))
        if old:
            keys[:, :, :old].copy_(self.keys)
            values[:, :, :old].copy_(self.values)
        self._key_buffer, self._value_buffer, self._room = keys, values, room


class GrowingCache(DynamicCache):
    """A DynamicCache (so every check for one still holds) made of GrowingLayers; FP8 with `quant`."""

    def __init__(self, quant: KVQuant | None = None) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        self.quant = quant

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.quant is not None:  # the layer learns its format and scales before its first write
            while len(self.layers) <= layer_idx:
                self.layers.append(GrowingLayer())
            self.layers[layer_idx].fp8 = (self.quant.fmt, *self.quant.scales(layer_idx))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
