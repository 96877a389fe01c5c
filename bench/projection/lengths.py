"""Where the simulator's rows get their lengths and prompts (bench/projection/sim.py's SimEngine and
`simulate` run on these): `Lengths`, each simulated trajectory's response length and how it ends
(a recorded run's, or drawn from given groups), with the placeholder tokens that keep a replay's
shared response prefixes shared; `ReplayStream`, a recorded run's groups in its order; and
`SyntheticStream`, placeholder prompts for lengths given as a distribution.
"""

from __future__ import annotations

import zlib

from rlrecipe.trajectory.record import Status, Trajectory


def _draw(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n


_DIGITS: list[bytes] = []


def _digits(n: int) -> list[bytes]:
    """b"0", b"1", ... up to n at least: the positions Lengths.tokens checksums, formatted once."""
    if len(_DIGITS) < n:
        _DIGITS.extend(b"%d" % i for i in range(len(_DIGITS), max(n, 2 * len(_DIGITS))))
    return _DIGITS


class Lengths:
    """The response length (and how it ends) of each simulated trajectory.

    `shared`: uid -> {uid: first response tokens in common}, for members of one group whose
    responses began alike (a replay prefills identical partial responses once, as the engines do).
    `known`: uid -> (length, status) of a recorded run (replay). Trajectories not in it (a
    schedule that drew more prompts than the recorded one) take a recorded group's lengths,
    chosen by a hash of their group id, or, with `groups` (lists of response lengths, one list
    per prompt; a flat list is one length per trajectory), a group from those.
    """

    def __init__(self, max_new_tokens: int, known: dict[str, tuple[int, str]] | None = None,
                 groups: list[list[int]] | list[int] | None = None, shared: dict[str, dict[str, int]] | None = None):
        self.max_new_tokens = max_new_tokens
        self.known = known or {}
        self.shared = shared or {}
        if groups is None:
            by_group: dict[str, list[tuple[int, str]]] = {}
            for uid, v in self.known.items():
                by_group.setdefault(uid.rsplit("#", 1)[0], []).append(v)
            self.groups = [g for g in by_group.values()]
        else:
            self.groups = [[(int(x), "")] for x in groups] if groups and not isinstance(groups[0], list) else [
                [(int(x), "") for x in g] for g in groups]
        if not self.known and not self.groups:
            raise ValueError("no lengths to simulate with")
        self._finish: dict[str, int | None] = {}  # uid -> finish_at: a uid's lengths never change

    def __call__(self, t: Trajectory) -> tuple[int, str]:
        if t.uid in self.known:
            return self.known[t.uid]
        member = t.uid.rsplit("#", 1)
        j = int(member[1]) if len(member) == 2 and member[1].isdigit() else _draw(t.uid, 1 << 16)
        group = self.groups[_draw(member[0], len(self.groups))]
        return group[j % len(group)]

    def same_so_far(self, a: Trajectory, b: Trajectory) -> bool:
        """Whether a and b (one prompt) hold the same response so far."""
        n = len(a.response_ids)
        if n != len(b.response_ids):
            return False
        common = self.shared.get(a.uid, {}).get(b.uid, self.shared.get(b.uid, {}).get(a.uid, 0))
        return common >= n

    def token(self, t: Trajectory) -> int:
        """A placeholder for t's next token: the same as the earliest group member's whose response
        began alike at least this far, else t's own (so a recorded replay re-records the same
        sharing, and responses that did not share differ)."""
        return self._token_at(t.uid, len(t.response_ids))

    def _token_at(self, uid: str, n: int) -> int:
        owner = next((other for other, common in self.shared.get(uid, {}).items() if common > n), uid)
        return 3 + zlib.crc32(f"{owner}:{n}".encode()) % (1 << 30)

    def tokens(self, t: Trajectory, k: int) -> list[int]:
        """`token` for t's next `k` positions, as k calls appending one at a time would give them. A
        trajectory that shares with no other is its own owner throughout: its prefix's CRC is taken
        once and continued (zlib.crc32(b, crc32(a)) == crc32(a + b))."""
        n = len(t.response_ids)
        if self.shared.get(t.uid):
            return [self._token_at(t.uid, i) for i in range(n, n + k)]
        head, crc = zlib.crc32(f"{t.uid}:".encode()), zlib.crc32
        return [3 + crc(d, head) % (1 << 30) for d in _digits(n + k)[n:n + k]]

    def finish_at(self, t: Trajectory) -> int | None:
        """The response length at which `t` says eos, or None: it runs to max_new_tokens."""
        if t.uid in self._finish:
            return self._finish[t.uid]
        length, status = self(t)
        out = length if status == Status.FINISHED.value or (not status and length < self.max_new_tokens) else None
        self._finish[t.uid] = out
        return out


class ReplayStream:
    """Hands out the groups a recorded run drew, in its order (same uids, same prompt lengths); past
    its end, the recorded groups again under new ids. Prompt tokens are placeholders."""

    def __init__(self, recorded: list[list]):
        self.groups: list[tuple[str, int]] = []  # group id, prompt length
        for _, gid, prompt_len, *_ in recorded:
            if not self.groups or self.groups[-1][0] != gid:
                self.groups.append((gid, prompt_len))
        self.cursor = 0

    def next_group(self, n: int) -> list[Trajectory]:
        lap, i = divmod(self.cursor, len(self.groups))
        gid, prompt_len = self.groups[i]
        gid = gid if lap == 0 else f"{gid}~{lap}"
        self.cursor += 1
        prompt = [1] * prompt_len
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=prompt, group_id=gid) for j in range(n)]


class SyntheticStream:
    """Groups of `prompt_len`-token placeholder prompts, for lengths given as a distribution."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.cursor = prompt_len, 0

    def next_group(self, n: int) -> list[Trajectory]:
        gid = f"p{self.cursor}"
        self.cursor += 1
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=[1] * self.prompt_len, group_id=gid) for j in range(n)]
