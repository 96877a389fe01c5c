"""The in-process engine's attention: a packed prefill attended per document, decoding by bands.

A packed prefill lays the sequences to prefill end to end in one row, positions restarting at
each; its attention keeps each document to itself (flash-attention's varlen convention,
`cu_seq_lens_q`), computed band by band of documents of similar length.

Decoding attends by bands of lengths. Rows are kept longest first (newcomers are prefilled in
that order and merged into it; every row grows by one token a step, so the order holds), and a
step's attention runs once per band of rows whose longest is at most PAD_RATIO x its shortest,
over only the cache columns that longest row fills. Without the bands every row would attend over
the width of the longest row in flight, and C3PO++ decodes resumed long rollouts beside fresh
short ones, so much of that would be padding (docs/performance.md has the measurements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "rollout_sdpa"
PAD_RATIO = 1.25  # a packed prefill attends documents in bands whose longest is at most this x the shortest


def _prefill_or_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, except for a packed prefill (called with `cu_seq_lens_q`, flash-attention's
    varlen convention): causal attention within each document only.

    Documents are attended in batches of similar length (the engine packs them sorted by length):
    each batch right-padded to its longest, at most PAD_RATIO times its shortest, one causal SDPA
    call each. A real query at position i sees keys 0..i only, all of its own document, so the
    padding past a document's end is never attended to and the result is exact; attention costs
    sum L_i^2 within that bound, and the number of calls stays small (one per length band) where
    a call per document would cost more in overhead than in arithmetic on CPU."""
    bands = kwargs.pop("decode_bands", None)
    if cu_seq_lens_q is None and bands is not None and query.shape[2] == 1:
        return _banded_decode(module, query, key, value, attention_mask, bands, dropout, scaling, **kwargs)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_mask is not None or key.shape[2] != query.shape[2]:
        raise ValueError("a packed prefill is one row, with no mask and no cached past")
    bounds = cu_seq_lens_q.tolist()
    docs = list(zip(bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)], strict=True))
    bands: list[list[tuple[int, int]]] = []  # runs of consecutive documents, longest <= PAD_RATIO x shortest
    for d in docs:
        if bands and max(bands[-1][-1][1], d[1]) <= PAD_RATIO * min(bands[-1][0][1], d[1]):
            bands[-1].append(d)
        else:
            bands.append([d])
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    gqa = q.shape[0] != k.shape[0]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]: transformers' layout, batch dim aside
    for band in bands:
        start, longest = band[0][0], max(n for _, n in band)
        if all(n == longest for _, n in band):  # contiguous, equal lengths: a view, no copy
            qs, ks, vs = (x[:, start:start + len(band) * longest].unflatten(1, (len(band), longest)).transpose(0, 1)
                          for x in (q, k, v))
        else:
            starts = torch.tensor([s for s, _ in band])[:, None]
            lens = torch.tensor([n for _, n in band])[:, None]
            cols = torch.arange(longest)[None]
            idx = (starts + torch.minimum(cols, lens - 1)).reshape(-1)  # past the end: repeat (never attended)
            qs, ks, vs = (x.index_select(1, idx).unflatten(1, (len(band), longest)).transpose(0, 1)
                          for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa)
        o = o.transpose(1, 2)  # [documents, longest, H, D]
        tokens = sum(n for _, n in band)
        if tokens == o.shape[0] * longest:
            out[start:start + tokens] = o.reshape(tokens, *o.shape[2:])
        else:  # the band's real positions, in packed order
            doc, pos = torch.nonzero(cols < lens, as_tuple=True)
            out[start:start + tokens] = o[doc, pos]
    return out.unsqueeze(0), None  # [1, T, H, D]


def decode_bands(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, width) of each band of a decoding batch whose rows are ordered longest
    first (`lengths`: each row's cache length): the band's longest at most PAD_RATIO x its shortest."""
    bands = []
    start = 0
    while start < len(lengths):
        longest = lengths[start]
        end = start + 1
        while end < len(lengths) and longest <= PAD_RATIO * lengths[end]:
            end += 1
        bands.append((start, end, longest))
        start = end
    return bands


def band_cells(bands: list[tuple[int, int, int]]) -> int:
    """Cache cells a decoding step attends under `bands`: each band's rows x its width."""
    return sum((end - start) * width for start, end, width in bands)


def _banded_decode(module, query, key, value, attention_mask, bands, dropout, scaling, **kwargs):
    """A decoding step's attention band by band: each band's rows attend only to the last `width`
    columns of the left-padded cache, those its longest row fills (the columns left of them are
    padding for every row of the band). Rows longest first are what makes the bands contiguous
    slices: views, no copies."""
    kv = key.shape[2]
    out = query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])  # [rows, 1, H, D]
    for start, end, width in bands:
        cols = slice(kv - width, kv)
        mask = attention_mask[start:end, ..., cols] if attention_mask is not None else None
        out[start:end], _ = sdpa_attention_forward(module, query[start:end], key[start:end, :, cols],
                                                   value[start:end, :, cols], mask, dropout=dropout,
                                                   scaling=scaling, **kwargs)
    return out, None


def register_attention() -> str:
    """Make `rollout_sdpa` an attention (and mask) implementation transformers' models accept."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _prefill_or_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # decoding steps get sdpa's padding mask
    return ATTENTION
