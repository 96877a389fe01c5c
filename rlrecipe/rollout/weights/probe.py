"""A check through generation itself, for servers no exact check reaches (SGLang before 0.5.12 with
Qwen2: no checksums, no /get_weights_by_name), or where the checksums cannot decide.

The trainer scores a few fixed sequences (`probe_sequences`) under the weights it pushes, teacher-
forced; each server scores them too (SGLang's /generate with return_logprob, logprob_start_len 0:
`meta_info.input_token_logprobs`, the first token's null), both at temperature 1: SGLang computes
input log-probs from the raw logits whatever the sampling temperature. The server must be measurably closer
to the trainer's log-probs under the new weights than under the previous push's: by at least half
of what the push moved them, per token on average. Where a push moved them less than the noise
between the two implementations (bf16 kernels against the trainer's), the check says it cannot
decide; a server whose log-probs are far from both holds other weights.

Under trainer.lora the probe names the servers' current adapter (`lora_path`, the fleet's
`adapter`): it is the only check of an adapter push, the base weights never move. A server that
refuses the probe under that name (never loaded it) is a failed push, not an undecided one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

PROBE_TEXTS = ("Find the sum of all positive integers n such that n^2 + 3n + 2 is divisible by 7.",
               "Let x be a real number with x + 1/x = 3. Compute x^3 + 1/x^3, step by step.",
               "The quick brown fox jumps over the lazy dog; then it counts: 2, 3, 5, 7, 11, 13.",
               "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n")
PROBE_TOKENS = 32
# mean |log-prob difference| per token beyond which a server holds neither the new nor the previous
# weights: far above what bf16 kernels make of the same weights (a few hundredths)
OTHER_WEIGHTS_NATS = 0.5
MIN_MARGIN_NATS = 1e-4


def probe_sequences(tokenizer) -> list[list[int]]:
    """The fixed sequences every push is scored on (PROBE_TOKENS tokens at most each)."""
    return [ids[:PROBE_TOKENS] for ids in (tokenizer.encode(t) for t in PROBE_TEXTS) if len(ids) >= 2]


class AdapterRefused(Exception):
    """A server refused the probe under the adapter it should serve."""


@dataclass
class Scores:
    """The trainer's log-probs of the probe under the weights of one version (tokens 1.. of each)."""

    version: int
    sequences: list[list[int]]
    logprobs: list[list[float]]


def server_scores(servers, i: int, scores: Scores) -> list[list[float]] | None:
    """Server i's teacher-forced log-probs of the probe, under its current adapter if any; None
    where it does not give them, AdapterRefused where it refuses the adapter."""
    out = []
    adapter = getattr(servers, "adapter", None)
    for seq in scores.sequences:
        body = {"input_ids": seq, "return_logprob": True, "logprob_start_len": 0, "rid": uuid.uuid4().hex,
                "sampling_params": {"max_new_tokens": 1}, **({"lora_path": adapter} if adapter else {})}
        r = servers.post(i, "/generate", body, timeout=(30.0, 300.0))
        if adapter and r.status_code != 200:
            raise AdapterRefused(f"HTTP {r.status_code}: {r.text[:300]}")
        try:
            entries = (r.json().get("meta_info") or {}).get("input_token_logprobs") if r.status_code == 200 else None
        except ValueError:
            entries = None
        if isinstance(entries, list) and len(entries) == len(seq):
            entries = entries[1:]  # the first token's: null, nothing before it
        if not isinstance(entries, list) or len(entries) != len(seq) - 1 or any(e[0] is None for e in entries):
            return None
        out.append([float(e[0]) for e in entries])
    return out


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / max(1, len(diffs))


def judge_scores(server: list[list[float]], new: Scores, prev: Scores | None) -> tuple[str, str]:
    """("ok" | "stale" | "wrong" | "undecided", detail) for a server's log-probs of the probe."""
    d_new = _mean_abs(server, new.logprobs)
    if prev is None:
        if d_new > OTHER_WEIGHTS_NATS:
            return "wrong", f"its log-probs of the probe are {d_new:.3g} nats per token from the trainer's"
        return "undecided", (f"its log-probs of the probe are {d_new:.2g} nats per token from the trainer's, "
                             "with no earlier push to compare with")
    d_prev, moved = _mean_abs(server, prev.logprobs), _mean_abs(new.logprobs, prev.logprobs)
    said = (f"{d_new:.2g} nats per token from the trainer's under version {new.version}, {d_prev:.2g} from "
            f"version {prev.version}'s; the push moved them by {moved:.2g}")
    if min(d_new, d_prev) > OTHER_WEIGHTS_NATS:
        return "wrong", said
    if abs(d_prev - d_new) < max(0.5 * moved, MIN_MARGIN_NATS):
        return "undecided", said
    return ("ok", said) if d_new < d_prev else ("stale", said)
