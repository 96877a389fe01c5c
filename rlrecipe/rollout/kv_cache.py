"""The in-process engine's KV cache: transformers' DynamicCache with room to grow.

DynamicCache appends each decoding step's keys and values with `torch.cat`, which copies the
whole cache, every layer, every step; at the sizes C3PO++ decodes on CPU that copy cost more
than the attention itself (docs/performance.md has the measurements).
Here each layer keeps its keys and values in a buffer with spare columns: a step writes one
column, and the buffer is copied only when it fills (a quarter of its length is added each time)
or when the engine has replaced the tensors itself (joining, compacting, re-laying a packed
prefill), which it does between steps, not within them. `keys`/`values` stay what transformers
and the engine expect: [rows, heads, length, head_dim] tensors, here views into the buffer.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

MIN_ROOM = 32  # spare columns added at the least when a buffer is (re)made


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `update` writes into spare room instead of concatenating."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._view: torch.Tensor | None = None  # the keys view last handed out; anything else was replaced
        self._room = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.dim() == 4 else 0  # lazy_initialization leaves an empty 1-d tensor
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
    """A DynamicCache (so every check for one still holds) made of GrowingLayers."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
