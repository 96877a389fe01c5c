"""Attention that follows the documents of a packed micro-batch (cost sum L_i^2, not T^2).

Training packs several sequences into one row whose position ids restart at each sequence.
Under `sdpa`, transformers turns that into a block-diagonal T x T mask and computes attention
over the whole row, masked: packing then costs more than padding. flash-attention's varlen
kernels avoid that (cumulative sequence lengths from the position ids), but need the flash-attn
package; this is the same idea with torch alone: one causal scaled-dot-product attention per
document (on CUDA each is a flash kernel with no mask), registered with
transformers' attention interface as `varlen_sdpa`.

transformers builds no mask for an implementation it does not know, so this one is only for
inputs with no padding: a single packed row (the training engines' only input). A batch of
several rows or an attention mask is refused rather than silently attended across.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "varlen_sdpa"


def document_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in a packed row: a document starts where its position is 0."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], pos.numel()]
    return list(zip(starts, ends, strict=True))


_last_lengths: tuple[torch.Tensor, int, list[int]] | None = None


def document_lengths(position_ids: torch.Tensor) -> list[int]:
    """Each document's length, found once per forward: every layer, and gradient checkpointing's
    recompute, passes the same position ids tensor, and on CUDA finding them is a device sync
    (`nonzero`, `tolist`), 28 a forward for the 7B model otherwise. The tensor is kept referenced, so
    the identity check cannot match a new tensor at a reused address; its version catches an
    in-place change."""
    global _last_lengths
    last = _last_lengths
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    lengths = [e - s for s, e in document_bounds(position_ids)]
    _last_lengths = (position_ids, position_ids._version, lengths)
    return lengths


def varlen_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, H_kv, T, D] -> output [1, T, H, D] (transformers' layout)."""
    if query.shape[0] != 1 or attention_mask is not None or position_ids is None:
        raise ValueError(f"{NAME} attends one packed row with position ids and no mask; got batch {query.shape[0]}, "
                         f"mask {'set' if attention_mask is not None else 'none'}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{NAME} has no sliding window")
    gqa = query.shape[1] != key.shape[1]
    # split, not one slice per document: a slice's backward writes a zero-filled tensor of the whole
    # row and adds it in (documents x T of memory traffic); split's backward is one concatenation.
    # One call per document, not padded batches of them: on CPU the kernel is compute-bound at these
    # lengths (the alternatives tried, and what they cost: docs/performance.md, "Packing").
    lengths = document_lengths(position_ids)
    outs = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)]
    # concatenated straight into transformers' [1, T, H, D] layout: one copy, not a cat and a transpose
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1), None


def register() -> str:
    """Make `varlen_sdpa` a name transformers' models accept; returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_sdpa_forward)
    return NAME


def training_attention(configured: str) -> str:
    """The attention a training engine loads its model with: `sdpa` becomes the per-document
    `varlen_sdpa` on every device (flash_attention_2 is varlen already). On an H100, a 7B packed
    micro-batch of 30,720 tokens in 4 documents ran forward + backward in 3.8 s this way against 9.3 s
    under sdpa's block-diagonal mask, and took 0.38 MiB a token against 0.49
    (`python -m bench.logprob_memory --model 7b --attn ...`)."""
    return register() if configured == "sdpa" else configured
