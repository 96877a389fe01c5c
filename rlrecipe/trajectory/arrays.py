"""Trajectories as flat arrays: one layout for the pool checkpoint and for the batch each RL step
hands to the trainer ranks.

Token ids and versions are int32, log-probs float32 (the trainer reads them as float32 anyway),
each per-token field concatenated over trajectories with its own int64 offsets (trajectory i's
part of field f is f[f.offsets[i]:f.offsets[i + 1]]); per-trajectory status, age, reward and
correct are small arrays. About 12 bytes a response token, against ~88 bytes as Python lists
(`python -m bench.batch_broadcast` measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import TypeVar

import numpy as np
import torch

from rlrecipe.core.dist import broadcast_arrays_from_rank_zero
from rlrecipe.trajectory.record import Status, Trajectory

T = TypeVar("T")

STATUSES = list(Status)
TOKEN_FIELDS = {"prompt_ids": torch.int32, "response_ids": torch.int32, "logp_infer": torch.float32,
                "versions": torch.int32}
_NUMPY = {torch.int32: np.int32, torch.float32: np.float32}


def _concat(trajs: list[Trajectory], name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [len(getattr(t, name)) for t in trajs]
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
    # chain.from_iterable walks the lists in C; numpy rounds each float to float32 as torch.tensor does
    flat = np.fromiter(chain.from_iterable(getattr(t, name) for t in trajs), dtype=_NUMPY[dtype],
                       count=int(offsets[-1]))
    return torch.from_numpy(flat), offsets


def pack_trajectories(trajs: list[Trajectory]) -> dict[str, torch.Tensor]:
    """Every numeric field as arrays: `name` and `name.offsets` per token field, then per trajectory
    status (index into STATUSES), age, reward (NaN for None) and correct (-1 for None)."""
    arrays: dict[str, torch.Tensor] = {}
    for name, dtype in TOKEN_FIELDS.items():
        arrays[name], arrays[f"{name}.offsets"] = _concat(trajs, name, dtype)
    arrays["status"] = torch.tensor([STATUSES.index(t.status) for t in trajs], dtype=torch.int8)
    arrays["age"] = torch.tensor([t.age for t in trajs], dtype=torch.int32)
    arrays["reward"] = torch.tensor([np.nan if t.reward is None else t.reward for t in trajs], dtype=torch.float64)
    arrays["correct"] = torch.tensor([-1 if t.correct is None else int(t.correct) for t in trajs], dtype=torch.int8)
    return arrays


def unpack_trajectories(arrays: dict[str, torch.Tensor], info: list[dict]) -> list[Trajectory]:
    """Trajectory objects back from `pack_trajectories` arrays and each one's uid, group_id,
    answers and meta (`info`, in order)."""
    fields = {}
    for name in TOKEN_FIELDS:
        flat, off = arrays[name].tolist(), arrays[f"{name}.offsets"].tolist()
        fields[name] = [flat[off[i]:off[i + 1]] for i in range(len(info))]
    out = []
    for i, d in enumerate(info):
        reward = float(arrays["reward"][i])
        correct = int(arrays["correct"][i])
        out.append(Trajectory(uid=d["uid"], group_id=d["group_id"], answers=d["answers"], meta=d["meta"],
                              prompt_ids=fields["prompt_ids"][i], response_ids=fields["response_ids"][i],
                              logp_infer=fields["logp_infer"][i], versions=fields["versions"][i],
                              status=STATUSES[int(arrays["status"][i])], age=int(arrays["age"][i]),
                              reward=None if np.isnan(reward) else reward,
                              correct=None if correct < 0 else bool(correct)))
    return out


class TrajectoryBatch:
    """A graded batch as `pack_trajectories` arrays plus each trajectory's uid and group id: what the
    trainer ranks get of rank 0's list of Trajectory. Per-trajectory accessors return views into the
    flat arrays, so no rank rebuilds per-token Python lists."""

    def __init__(self, arrays: dict[str, torch.Tensor], uids: list[str], group_ids: list[str]):
        if not len(uids) == len(group_ids) == len(arrays["status"]):
            raise ValueError(f"{len(uids)} uids, {len(group_ids)} group ids, {len(arrays['status'])} trajectories")
        self.arrays, self.uids, self.group_ids = arrays, uids, group_ids
        self._offsets = {name: arrays[f"{name}.offsets"].tolist() for name in TOKEN_FIELDS}  # n + 1 ints each

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory]) -> TrajectoryBatch:
        return cls(pack_trajectories(trajs), [t.uid for t in trajs], [t.group_id for t in trajs])

    def __len__(self) -> int:
        return len(self.uids)

    def _part(self, name: str, i: int) -> torch.Tensor:
        off = self._offsets[name]
        return self.arrays[name][off[i]:off[i + 1]]

    def prompt_ids(self, i: int) -> torch.Tensor:
        return self._part("prompt_ids", i)

    def response_ids(self, i: int) -> torch.Tensor:
        return self._part("response_ids", i)

    def logp_infer(self, i: int) -> torch.Tensor:
        return self._part("logp_infer", i)

    def versions(self, i: int) -> torch.Tensor:
        return self._part("versions", i)

    def input_ids(self, i: int) -> torch.Tensor:
        """Prompt then response token ids, int32 (a copy: the two live in different arrays)."""
        return torch.cat([self.prompt_ids(i), self.response_ids(i)])

    def prompt_length(self, i: int) -> int:
        off = self._offsets["prompt_ids"]
        return off[i + 1] - off[i]

    @property
    def response_lengths(self) -> list[int]:
        off = self._offsets["response_ids"]
        return [b - a for a, b in zip(off, off[1:], strict=False)]

    @property
    def rewards(self) -> list[float]:
        return self.arrays["reward"].tolist()

    @property
    def correct(self) -> list[bool | None]:
        return [None if c < 0 else bool(c) for c in self.arrays["correct"].tolist()]

    @property
    def statuses(self) -> list[Status]:
        return [STATUSES[s] for s in self.arrays["status"].tolist()]


def broadcast_batch_from_rank_zero(fn: Callable[[], tuple[TrajectoryBatch, T]]) -> tuple[TrajectoryBatch, T]:
    """Rank 0's `(batch, small)` from `fn` on every rank: the batch's arrays by tensor broadcast, its
    uids and group ids and `small` pickled. No rank unpickles per-token Python lists."""
    def parts():
        batch, small = fn()
        return batch.arrays, (batch.uids, batch.group_ids, small)

    arrays, (uids, group_ids, small) = broadcast_arrays_from_rank_zero(parts)
    return TrajectoryBatch(arrays, uids, group_ids), small
