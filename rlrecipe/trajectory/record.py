"""The one record that flows from rollout to trainer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Status(StrEnum):
    RUNNING = "running"      # unfinished: may resume (C3PO++ keeps it in the pool)
    FINISHED = "finished"    # ended with eos
    TRUNCATED = "truncated"  # hit max_new_tokens: graded as wrong
    ABORTED = "aborted"      # dropped (too stale, or the engine gave up on it)


@dataclass
class Trajectory:
    """One sampled response and everything needed to train on it.

    Every response token keeps the log-prob the engine sampled it with (`logp_infer`) and the
    policy version that produced it, so IcePop and staleness stay exact across resumes.
    """

    uid: str
    prompt_ids: list[int]
    group_id: str = ""
    answers: list[str] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logp_infer: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    status: Status = Status.RUNNING
    reward: float | None = None
    correct: bool | None = None
    age: int = 0  # optimizer steps this trajectory has waited unfinished in the pool
    meta: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.TRUNCATED)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, token: int, logp: float, version: int) -> None:
        self.response_ids.append(token)
        self.logp_infer.append(logp)
        self.versions.append(version)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["status"] = Status(d["status"])
        return cls(**d)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    greedy: bool = False
    # stress test (rollout.stress_logit_noise): std of Gaussian noise on the logits before sampling
    logit_noise: float = 0.0
