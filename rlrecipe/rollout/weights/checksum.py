"""Weight checksums as SGLang's `/weights_checker` computes them (action "checksum", SGLang >= 0.5.12).

SGLang answers {"success", "message", "ranks": [{"checksums": {name: 16 hex digits}, "per_gpu_checksum",
"parallelism_info"}, ...]}: one entry per tensor-parallel rank, a checksum per parameter and buffer
under the server's own names (fused ones such as qkv_proj have no HF counterpart; row-parallel ones
are that rank's shard), rotary caches left out. For a tensor held on the CPU the checksum is the
first 8 bytes of the SHA-256 of its raw bytes, big-endian; on a GPU SGLang uses its Triton hash
(kernels/ops/memory/gpu_tensor_hash.py). That one is deterministic too (a fixed seed over the
tensor's bytes), so a trainer on a GPU could compute it with SGLang's kernel; this client does not
(it would import SGLang into the trainer). So two checks come out of it, decided per tensor:

- exact: where the server hashes as `tensor_checksum` does (every tensor of a server on the CPU;
  on a GPU server, those it holds on the CPU, --cpu-offload-gb), the tensors both sides name alike
  must match, bit for bit, once the trainer's is cast to the served dtype. Only tensors no rank
  shards are compared this way (1-D ones) unless the server has one rank.
- changed: the trainer's tensors that changed since the previous push (in the served dtype) must
  have changed on every rank of the server too. A server that answered 200 and kept its weights
  fails this whatever its hash; at a small learning rate most bf16 values stay put, but a tensor of
  millions of them does not (docs/gpu.md has the figures).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
# SGLang's VocabParallelEmbedding (the embedding and the LM head) holds the vocabulary rows padded with
# zeros to a multiple of DEFAULT_VOCAB_PADDING_SIZE, and hashes the padded tensor.
VOCAB_PADDING = 64
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def tensor_checksum(t: torch.Tensor) -> str:
    """A CPU tensor's checksum as SGLang's weight checker writes it (16 hex digits)."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], 'big'):016x}"


def as_served(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor as a one-rank SGLang server holds it: vocabulary rows zero-padded to a multiple of 64."""
    rows = t.shape[0] if t.dim() == 2 else 0
    if not name.endswith(VOCAB_TENSORS) or rows % VOCAB_PADDING == 0:
        return t
    padded = t.new_zeros((rows + VOCAB_PADDING - rows % VOCAB_PADDING, t.shape[1]))
    padded[:rows] = t
    return padded


def served_checksum(name: str, t: torch.Tensor) -> str:
    """The checksum a one-rank server on the CPU gives the trainer's tensor `name`."""
    return tensor_checksum(as_served(name, t))


def model_checksums(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every tensor's checksum, rotary caches left out, as a one-rank server answers."""
    return {n: served_checksum(n, t) for n, t in named.items() if not any(p in n for p in NON_PERSISTENT)}


def rank_checksums(answer: dict) -> list[dict[str, str]] | None:
    """The per-rank {name: checksum} of a /weights_checker answer; None when it has none."""
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not isinstance(ranks, list) or not ranks:
        return None
    out = [r.get("checksums") for r in ranks if isinstance(r, dict)]
    return out if out and all(isinstance(c, dict) for c in out) else None


@dataclass
class ServerChecksums:
    """What one server answered when it was last verified, the trainer's checksums then, and the
    weight version it was verified to hold."""

    ranks: list[dict[str, str]]
    trainer: dict[str, str] = field(default_factory=dict)
    version: int = 0


def hashes_on_cpu(server_info: dict) -> bool:
    """Whether a server's checksums are computed as `tensor_checksum` does: its weights are not on
    CUDA (SGLang hashes CUDA tensors with Triton, any other tensor with SHA-256)."""
    device = server_info.get("device")
    return isinstance(device, str) and device not in ("cuda", "rocm", "")


def judge(ranks: list[dict[str, str]], trainer: dict[str, str], before: ServerChecksums | None,
          cpu_hash: bool = False) -> tuple[str, str]:
    """("ok" | "wrong" | "stale" | "undecided", detail) for a server's checksums `ranks` after a push,
    given the trainer's checksums of the same push (its tensors cast to the served dtype) and what
    both said when the server was last verified (None: nothing to compare with). "stale": the
    server answers as it did then, while the trainer's tensors changed.

    Which tensors the server hashes as the trainer does is decided per tensor: every one on a
    server known to hash on the CPU (`cpu_hash`); on a GPU server, those it holds on the CPU
    (--cpu-offload-gb), known where a checksum agrees now or agreed at the last verification.
    Those are compared bit for bit; every other must have changed on every rank where the
    trainer's changed."""
    comparable = {n for n in trainer if all(n in r for r in ranks)}
    if len(ranks) > 1:  # a shard's checksum is not the whole tensor's: compare only what no rank shards
        comparable = {n for n in comparable if len({r[n] for r in ranks}) == 1}

    def agreed_before(n: str) -> bool:
        return before is not None and n in before.trainer and before.ranks[0].get(n) == before.trainer[n]

    exact = comparable if cpu_hash else {n for n in comparable if ranks[0][n] == trainer[n] or agreed_before(n)}
    if exact:
        off = sorted(n for n in exact if ranks[0][n] != trainer[n])
        if off and before is not None and all(n in r for r in before.ranks for n in off) and all(
                now[n] == prev[n] for now, prev in zip(ranks, before.ranks, strict=False) for n in off):
            return "stale", f"{len(off)} of {len(exact)} tensors compared differ from the trainer's"
        if off:
            return "wrong", f"{len(off)} of {len(exact)} tensors differ from the trainer's, e.g. {off[0]}"
    matched = f"{len(exact)} tensors match the trainer's bit for bit"
    rest = {n: h for n, h in trainer.items() if n not in exact}
    if not rest or cpu_hash:
        return ("ok", matched) if exact else ("undecided", "no tensor of the trainer's is named alike on the server")
    verdict, detail = _judge_changed(ranks, rest, before)
    if exact and verdict == "undecided":
        return "ok", f"{matched}; the other {len(rest)} are hashed on the GPU: {detail}"
    return verdict, f"{matched}; {detail}" if exact else detail


def _judge_changed(ranks: list[dict[str, str]], trainer: dict[str, str],
                   before: ServerChecksums | None) -> tuple[str, str]:
    """The check where the server hashes otherwise (a GPU hash): every tensor the trainer changed
    since the last verification must have changed on every rank too."""
    if before is None:
        return "undecided", "its checksums are not computed as the trainer's (a GPU hash) and there is no earlier push"
    changed = sorted(n for n in trainer if n in before.trainer and trainer[n] != before.trainer[n]
                     and all(n in r for r in ranks) and all(n in r for r in before.ranks))
    if not changed:
        return "undecided", "none of the trainer's compared tensors changed since the previous push"
    for k, (now, prev) in enumerate(zip(ranks, before.ranks, strict=False)):
        kept = [n for n in changed if now[n] == prev[n]]
        if len(kept) == len(changed):
            return "stale", f"rank {k}: none of the {len(changed)} tensors the trainer changed since then changed"
        if kept:
            return "wrong", f"rank {k}: {len(kept)} of {len(changed)} tensors the trainer changed did not change, e.g. {kept[0]}"
    return "ok", f"the {len(changed)} tensors the trainer changed changed on every rank"
