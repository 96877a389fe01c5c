"""The in-process engine's side of a colocated step (rollout.colocate), held to SGLang's rules.

A release discards the weights (each parameter's storage freed, its shape kept); a resume allocates
them again filled with NaN, which is what an engine that never received the push would sample
from, so generation is refused until a push lands. The in-process engine keeps no KV cache between
calls, so releasing "kv_cache" only bars generation until it is resumed; "cuda_graph" is accepted
and frees nothing. As on SGLang, a release with a tag already released, or a resume of a tag that
is not, is an error (SGLang's scheduler dies of it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlrecipe.rollout.base import MEMORY_TAGS


class EngineMemory:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.released: set[str] = set()
        self.unpushed = False  # weights resumed, no push since: garbage
        self._shapes: dict[str, torch.Size] = {}

    def _tags(self, tags: Sequence[str]) -> list[str]:
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if not tags or unknown:
            raise ValueError(f"memory tags {list(tags)!r}: expected some of {', '.join(MEMORY_TAGS)}")
        return list(tags)

    def release(self, tags: Sequence[str]) -> None:
        tags = self._tags(tags)
        again = [t for t in tags if t in self.released]
        if again:
            raise RuntimeError(f"release_memory {again}: already released")
        if "weights" in tags:
            for name, p in self.model.named_parameters(remove_duplicate=True):
                self._shapes[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released.update(tags)

    def resume(self, tags: Sequence[str]) -> None:
        tags = self._tags(tags)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise RuntimeError(f"resume_memory {missing}: not released")
        if "weights" in tags:
            for name, p in self.model.named_parameters(remove_duplicate=True):
                p.data = torch.full(self._shapes[name], float("nan"), dtype=p.dtype, device=p.device)
            self.unpushed = True
        self.released.difference_update(tags)

    def pushed(self) -> None:
        if "weights" in self.released:
            raise RuntimeError("a weight update while the weights are released: resume_memory(['weights']) first")
        self.unpushed = False

    def check_can_generate(self) -> None:
        held = sorted(self.released - {"cuda_graph"})
        if held:
            raise RuntimeError(f"generate while {', '.join(held)} released: resume_memory first")
        if self.unpushed:
            raise RuntimeError("generate with weights resumed but never pushed: they are garbage until a "
                               "weight update lands")
