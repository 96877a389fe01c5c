"""What each SGLang version in the pin accepts, as read from its released packages.

The pin (`pyproject.toml`'s `gpu` extra) is the range the client was checked against; the table
in docs/gpu.md says what differs inside it, and `tests/data/sglang_contract.json` holds the
endpoints and fields of its two ends. A server's version comes from its /server_info.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the two ends of the pin; a server of an unknown version is spoken to as the newest
LOWEST, NEWEST = (0, 5, 1), (0, 5, 23)

# sampling_params keys the client may send: SGLang's own list in every version of the pin
SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
                           "skip_special_tokens", "no_stop_trim"})


def parse_version(text: object) -> tuple[int, ...] | None:
    """(0, 5, 23) from "0.5.23", "0.5.3.post1" or "0.5.10rc0"; None for anything else."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return tuple(int(x) for x in m.groups()) if m else None


@dataclass(frozen=True)
class Dialect:
    """The rules of one server's SGLang version (None: not stated, taken as the newest)."""

    version: tuple[int, ...] | None

    def _from(self, *first: int) -> bool:
        return (self.version or NEWEST) >= first

    @property
    def sampling_seed(self) -> bool:
        """`sampling_params.sampling_seed` exists (before 0.5.3 it is an unexpected keyword: HTTP 500)."""
        return self._from(0, 5, 3)

    @property
    def weight_update_session(self) -> bool:
        """/update_weights_from_distributed must run between /begin_weight_update and /end_weight_update."""
        return self._from(0, 5, 21)

    @property
    def destroy_group(self) -> bool:
        """/destroy_weights_update_group is routed."""
        return self._from(0, 5, 3)

    @property
    def weights_checksum(self) -> bool:
        """/weights_checker takes action "checksum" (per-tensor checksums)."""
        return self._from(0, 5, 12)

    @property
    def full_context(self) -> bool:
        """input + max_new_tokens may equal the context length (before 0.5.11 it must stay below).
        A server of unknown version is given the stricter rule."""
        return self.version is not None and self.version >= (0, 5, 11)

    def label(self) -> str:
        return ".".join(map(str, self.version)) if self.version else "unknown version"


def dialect_of(server_info: dict) -> Dialect:
    """The dialect a /server_info answer states (an answer without a version: the unknown one). A
    server that does not answer is not given one: `ServerFleet.server_info` raises instead."""
    return Dialect(parse_version(server_info.get("version")))


def room(dialect: Dialect, context: int | None, max_input: int | None, n_input: int) -> int | None:
    """New tokens a request of `n_input` tokens may ask for without being refused: None when no
    limit is known, 0 or less when it cannot be sent at all. SGLang refuses an input of
    max_req_input_len tokens or more, and input + new above the context (at it, before 0.5.11)."""
    if max_input is not None and n_input >= max_input:
        return 0
    if context is None:
        return None
    return context - n_input - (0 if dialect.full_context else 1)
