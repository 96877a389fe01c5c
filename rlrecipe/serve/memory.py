"""The memory a colocated `rlrecipe serve` gives up while the trainer trains: SGLang's
/release_memory_occupation and /resume_memory_occupation, held to a stricter reading than SGLang's.

What SGLang 0.5.23 does (sglang/srt/managers/scheduler_components/weight_updater.py,
release_memory_occupation / resume_memory_occupation; sglang/srt/utils/torch_memory_saver_adapter.py):

- without --enable-memory-saver the adapter is a no-op: both calls answer 200 and free nothing.
  Here they are refused (400), so a colocated layout that forgot the flag fails at its first step
  instead of running out of GPU memory later;
- a release asserts the scheduler is idle; the failed assertion kills the scheduler, which takes
  the server down (scheduler.py, run_scheduler_process: SIGQUIT to the parent). Here the process
  exits with status 70 and a message;
- tags are free strings (null or [] means all three); an unknown one is kept and does nothing.
  Here it is refused (400): a misspelt tag would keep its memory on a GPU without a word;
- a resume of a tag not released is a KeyError in the scheduler (`offload_tags.remove`), fatal as
  above; here too;
- released weights are discarded (no CPU backup unless --enable-weights-cpu-backup), so after a
  resume they hold whatever the allocator gives until a weight update lands. SGLang serves that
  garbage; here the resumed parameters are filled with NaN (the checksums and rows show it) and
  /generate is refused until every one of them was written again;
- /generate while weights or KV cache are released runs on freed memory in SGLang; here it is
  refused (400).
"""

from __future__ import annotations

import math
import threading

import torch

# sglang/srt/constants.py: GPU_MEMORY_TYPE_KV_CACHE, _WEIGHTS, _CUDA_GRAPH (GPU_MEMORY_ALL_TYPES)
TAGS = ("kv_cache", "weights", "cuda_graph")
FATAL_EXIT = 70  # what the process exits with when SGLang's scheduler would have died


class MemoryRefused(Exception):
    """A release or resume refused with 400 {"error": {"message"}} (SGLang's _create_error_response)."""


class Fatal(Exception):
    """What kills SGLang's scheduler, and with it the server."""


def parse_tags(body: dict, endpoint: str) -> list[str]:
    """The request's tags; null or [] means all, as SGLang's."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise MemoryRefused(f"{endpoint}: tags must be a list of strings, not {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise MemoryRefused(f"{endpoint}: unknown tag {unknown[0]!r}; the tags are {', '.join(TAGS)} "
                            "(SGLang would keep it and free nothing for it)")
    return list(dict.fromkeys(tags))


class MemoryOccupation:
    """Which regions are released, and which parameters are garbage since a weights resume."""

    def __init__(self, model: torch.nn.Module, enabled: bool):
        self.model = model
        self.enabled = enabled  # --enable-memory-saver
        self.released: set[str] = set()
        self.garbage: set[int] = set()  # data_ptr of parameters resumed and not written since
        self.lock = threading.Lock()

    def _need_flag(self, endpoint: str) -> None:
        if not self.enabled:
            raise MemoryRefused(f"{endpoint} needs a server launched with --enable-memory-saver (SGLang "
                                "answers 200 without it and frees nothing)")

    def release(self, body: dict, busy: int) -> None:
        """Release the tags' memory; `busy`: requests this server has queued or running."""
        endpoint = "/release_memory_occupation"
        self._need_flag(endpoint)
        tags = parse_tags(body, endpoint)
        if busy:
            raise Fatal(f"{endpoint} with {busy} request(s) queued or running: release_memory_occupation should "
                        "be called only when server is idle (SGLang's scheduler asserts this and dies)")
        with self.lock:
            self.released |= set(tags)

    def resume(self, body: dict) -> None:
        endpoint = "/resume_memory_occupation"
        self._need_flag(endpoint)
        tags = parse_tags(body, endpoint)
        with self.lock:
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise Fatal(f"{endpoint} of {missing[0]!r}, which is not released (SGLang's scheduler fails with "
                            "a KeyError and dies)")
            self.released -= set(tags)
            if "weights" in tags:
                # new memory, old contents gone: NaN stands for whatever the allocator hands back
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.fill_(math.nan)
                        self.garbage.add(p.data_ptr())

    def written(self, tensors: list[torch.Tensor] | None) -> None:
        """A weight update landed in `tensors` (the model's own; None: all of them)."""
        with self.lock:
            if tensors is None:
                self.garbage.clear()
            else:
                self.garbage -= {t.data_ptr() for t in tensors}

    def refusal(self) -> str | None:
        """Why a generation cannot run now, or None."""
        with self.lock:
            held = sorted({"weights", "kv_cache"} & self.released)
            if held:
                return (f"the server's {' and '.join(held)} memory is released: call /resume_memory_occupation "
                        "before generating")
            if self.garbage:
                return (f"{len(self.garbage)} weight tensor(s) hold nothing since /resume_memory_occupation "
                        "(released weights are discarded): push the weights before generating")
        return None
