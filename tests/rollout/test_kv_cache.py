"""The in-process engine's growing KV cache: DynamicCache's contents, without a copy per step."""

import torch
from transformers import DynamicCache

from rlrecipe.rollout.kv_cache import MIN_ROOM, GrowingCache


def kv(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)


def same(a: DynamicCache, b: DynamicCache) -> None:
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_holds_what_dynamic_cache_holds_through_steps_and_the_engines_edits():
    grow, plain = GrowingCache(), DynamicCache()
    assert isinstance(grow, DynamicCache)
    for layer in range(2):  # a prefill of 5 positions
        for c in (grow, plain):
            c.update(*kv(3, 5, layer), layer)
    same(grow, plain)
    buffer = grow.layers[0]._key_buffer
    for step in range(40):  # decoding steps, past the first buffer's room
        for layer in range(2):
            for c in (grow, plain):
                out = c.update(*kv(3, 1, 100 * step + layer), layer)
            assert torch.equal(out[0], plain.layers[layer].keys)
        same(grow, plain)
        if step == 10:  # 16 positions: still in the first buffer, written in place
            assert grow.layers[0]._key_buffer is buffer
            assert grow.layers[0].keys.data_ptr() == buffer.data_ptr()
    assert grow.layers[0]._key_buffer is not buffer  # 45 positions outgrew 5 + MIN_ROOM
    assert grow.layers[0]._room >= 45 and 5 + MIN_ROOM < 45

    # the engine's edits between steps: keep rows, drop left columns, left-pad and join other rows
    idx = torch.tensor([2, 0])
    for c in (grow, plain):
        c.batch_select_indices(idx)
        for layer in c.layers:
            layer.keys, layer.values = layer.keys[:, :, 3:], layer.values[:, :, 3:]
    same(grow, plain)
    for step in range(3):
        for layer in range(2):
            for c in (grow, plain):
                c.update(*kv(2, 1, 7000 + 10 * step + layer), layer)
        same(grow, plain)
    for c in (grow, plain):
        for i, layer in enumerate(c.layers):
            k, v = kv(1, layer.keys.shape[2], 9000 + i)
            layer.keys, layer.values = torch.cat([layer.keys, k]), torch.cat([layer.values, v])
    for layer in range(2):
        for c in (grow, plain):
            c.update(*kv(3, 1, 9900 + layer), layer)
    same(grow, plain)
    assert grow.layers[0].keys.shape == (3, 2, 46, 4)
