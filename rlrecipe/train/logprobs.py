"""Per-token log-prob and entropy of the sampled tokens without a micro-batch's full logits.

At the real vocabulary (V = 152,064) one fp32 logits row is 608 KB, so a 30,720-token
micro-batch would hold 18.7 GB per copy, and the plain path (`.float()`, `log_softmax`, the
entropy's `exp`) keeps several. Here the decoder's hidden states are kept (T x hidden, small),
and the LM head, softmax and gather run one chunk of tokens at a time. Under autograd each chunk
but the last is checkpointed: only its hidden rows are saved and its logits are recomputed in
backward, so peak memory is O(chunk x V) whatever the micro-batch length. (The last chunk's
backward runs first, so its logits are held either way: at V = 152,064 the measured peaks were
the same with it recomputed or kept, `python -m bench.logprob_memory --paths chunked`.) The
arithmetic per token is the same as the plain path's (logits in fp32, divided by the sampling
temperature).

The decoder output is taken with a forward hook while the whole model runs with an empty
`logits_to_keep`, so wrappers (DeepSpeed's engine and its ZeRO-3 parameter hooks) see an
ordinary forward call.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def decoder_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states [T, hidden] of a packed micro-batch; no logits are computed."""
    causal_lm = unwrap(model)
    captured: list[torch.Tensor] = []
    hook = causal_lm.get_decoder().register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        # no cache: lets transformers see the packing in the position ids
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
              logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device))
    finally:
        hook.remove()
    return captured[-1][0]


def _head_chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    logits.div_(temperature)  # in place: no second [chunk, V] copy (the cast saves nothing for backward)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, logp.new_zeros(())
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def chunk_sizes(rows: int, chunk_tokens: int) -> list[int]:
    """Chunk lengths covering `rows`: the remainder first, so that the last chunk (the one not
    recomputed, see `token_logprobs`) is a whole one."""
    whole, rest = divmod(rows, chunk_tokens)
    return ([rest] if rest else []) + [chunk_tokens] * whole


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target_t) and (optionally) the entropy of pi at each row of `hidden` [N, hidden].

    Gradients flow to `hidden` and the head's weights through log-probs and entropy alike."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, ents = [], []
    sizes = chunk_sizes(hidden.shape[0], chunk_tokens)
    for i, (h, t) in enumerate(zip(hidden.split(sizes), targets.split(sizes), strict=True)):
        # The last chunk is not recomputed: its backward runs first, while everything the forward
        # saved is still held, so recomputing it could not lower the peak, only cost its head twice.
        if grad and i < len(sizes) - 1:
            lp, en = checkpoint(_head_chunk, head, h, t, temperature, with_entropy, use_reentrant=False)
        else:
            lp, en = _head_chunk(head, h, t, temperature, with_entropy)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      predict_rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      chunk_tokens: int = 1024, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of `targets`, predicted from the hidden states at `predict_rows`
    of one packed micro-batch ([1, T] ids and positions)."""
    hidden = decoder_hidden_states(model, input_ids, position_ids)
    return token_logprobs(unwrap(model).get_output_embeddings(), hidden[predict_rows], targets, temperature,
                          chunk_tokens, with_entropy)
