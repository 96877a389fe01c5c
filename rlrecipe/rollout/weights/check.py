"""After each weight push, do the servers hold what the trainer sent? Checked on every server, every push.

An update that answers 200 says the server ran its load, not that the weights it serves are the
trainer's (a wrong file read, a shard mapped to the wrong place, a load that silently skipped, a
server that kept its previous weights). Two exact checks, each where the server offers it:

- `/weights_checker` checksums (SGLang >= 0.5.12, any model; `weights/checksum.py`): bit for bit
  where the server hashes as the trainer does, else every tensor the trainer changed must have
  changed on the server.
- `/get_weights_by_name` ({"name": HF parameter name, "truncate_size": rows} -> the parameter's
  first rows as float32 lists; one list per replica with dp_size > 1), which SGLang implements for
  Llama-like models only (not Qwen2). The rows are compared with the trainer's, cast as the server
  holds them, within one unit in the last place of the coarser dtype. Which parameters: a
  different handful each version (seeded by it), always the final norm, only ones of at most
  MAX_NUMEL elements: SGLang converts the whole parameter to a Python list before it truncates.
  A server one step behind can fall inside that tolerance in bf16; the checksums and the
  weight_version every answer carries catch that.

Where neither reaches a server, or the checksums cannot decide, the trainer's log-probs of a fixed
probe decide where the caller gave them (weights/probe.py); what no check can decide is said in one
line, never passed over.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlrecipe.core.errors import UserError
from rlrecipe.rollout.weights.checksum import (
    ServerChecksums,
    hashes_on_cpu,
    judge,
    rank_checksums,
    served_checksum,
)
from rlrecipe.rollout.weights.probe import AdapterRefused, Scores, judge_scores, server_scores

TRUNCATE_ROWS = 2
SAMPLES = 4
MAX_NUMEL = 16 * 2**20
ALWAYS = ("model.norm.weight",)


class WeightMismatch(UserError):
    """A server answered the update but does not serve the trainer's weights."""


def sample_names(shapes: dict[str, tuple[int, ...]], version: int, k: int = SAMPLES) -> list[str]:
    """The parameters checked after the push of `version`: the final norm and k - 1 others, at most
    MAX_NUMEL elements each, chosen by a generator seeded with the version."""
    eligible = sorted(n for n, s in shapes.items() if math.prod(s) <= MAX_NUMEL and len(s) >= 1)
    first = [n for n in ALWAYS if n in eligible]
    rest = [n for n in eligible if n not in first]
    return first + random.Random(version).sample(rest, min(len(rest), k - len(first)))


class TrainerWeights:
    """The trainer's weights as a check reads them: an in-memory state dict (the broadcast push) or
    an HF safetensors export (the disk push, the stage's starting model): only what is compared is
    read from disk."""

    def __init__(self, state: dict[str, torch.Tensor] | None = None, model_dir: str | Path | None = None):
        from rlrecipe.modeling import distinct_tensors

        self._state = dict(distinct_tensors(state)) if state is not None else None
        self._dir = Path(model_dir) if model_dir is not None else None
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            if self._state is not None:
                self._shapes = {n: tuple(t.shape) for n, t in self._state.items()}
            else:
                self._shapes = self._index()
        return self._shapes

    def _index(self) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        index = self._dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(self._dir.glob("*.safetensors"))]
        shapes = {}
        for f in files:
            with safe_open(self._dir / f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[name] = f
                    shapes[name] = tuple(st.get_slice(name).get_shape())
        return shapes

    def read(self, names: list[str], rows: int | None = None) -> dict[str, torch.Tensor]:
        """These tensors (their first `rows` rows only, where given), on the CPU."""
        if self._state is not None:
            return {n: self._state[n].detach()[:rows].to("cpu", copy=True) for n in names}
        from safetensors import safe_open

        self.shapes()
        out = {}
        for name in names:
            with safe_open(self._dir / self._where[name], framework="pt") as st:
                out[name] = st.get_slice(name)[:rows] if rows is not None else st.get_tensor(name)
        return out


def state_slices(state: dict[str, torch.Tensor], version: int, rows: int = TRUNCATE_ROWS) -> dict[str, torch.Tensor]:
    """The sampled parameters' first rows from an in-memory state dict."""
    w = TrainerWeights(state=state)
    return w.read(sample_names(w.shapes(), version), rows)


def export_slices(model_dir: str | Path, version: int, rows: int = TRUNCATE_ROWS) -> dict[str, torch.Tensor]:
    """The sampled parameters' first rows read from an HF safetensors export: only those rows are read."""
    w = TrainerWeights(model_dir=model_dir)
    return w.read(sample_names(w.shapes(), version), rows)


def tolerance(*dtypes: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for values cast through these dtypes: one unit in the last place of the coarsest,
    and its smallest normal number for values near zero."""
    coarsest = max(dtypes, key=lambda d: torch.finfo(d).eps)
    info = torch.finfo(coarsest)
    return info.eps, info.smallest_normal if coarsest == torch.float16 else info.tiny


def compare(expected: torch.Tensor, answer, served: torch.dtype | None) -> str | None:
    """None if a /get_weights_by_name answer matches `expected` (the trainer's rows); else what differs."""
    exp = expected.to(served).float() if served is not None else expected.float()
    try:
        got = torch.tensor(answer, dtype=torch.float32)
    except (TypeError, ValueError) as err:
        return f"an answer that is not a list of numbers ({err})"
    replicas = [got] if tuple(got.shape) == tuple(exp.shape) else (
        list(got) if got.dim() == exp.dim() + 1 and tuple(got.shape[1:]) == tuple(exp.shape) else None)
    if replicas is None:
        return f"shape {list(got.shape)} where the trainer's first rows are {list(exp.shape)}"
    rtol, atol = tolerance(expected.dtype, *((served,) if served is not None else ()))
    for k, rep in enumerate(replicas):
        off = (rep - exp).abs() > rtol * exp.abs() + atol
        if bool(off.any()) or not bool(torch.isfinite(rep).all()):
            worst = float((rep - exp).abs().nan_to_num(float("inf")).max())
            where = f" (dp replica {k})" if len(replicas) > 1 else ""
            return (f"{int(off.sum())} of {exp.numel()} values{where} differ, by up to {worst:.3g} "
                    f"(tolerance {rtol:.3g} x |value| + {atol:.3g})")
    return None


def stated_dtype(server_info: dict) -> torch.dtype | None:
    """The dtype a /server_info answer says the weights are held in; None for "auto" or none."""
    name = server_info.get("dtype") if isinstance(server_info, dict) else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def checksum_names(shapes: dict[str, tuple[int, ...]], served_names: set[str], k: int = SAMPLES) -> list[str]:
    """The trainer's tensors compared with a server's checksums: those it names alike, every 1-D
    one (norms) and k others of at most MAX_NUMEL elements, the same ones at every push."""
    common = sorted(n for n in shapes if n in served_names)
    flat = [n for n in common if len(shapes[n]) == 1]
    rest = [n for n in common if len(shapes[n]) > 1 and math.prod(shapes[n]) <= MAX_NUMEL]
    return flat + random.Random(0).sample(rest, min(len(rest), k))


class WeightCheck:
    """Verifies, after each push and at start, that each server holds the trainer's weights: by
    SGLang's /weights_checker checksums where the server has them (weights/checksum.py), and by
    /get_weights_by_name rows where the model supports it (SGLang implements it for Llama-like
    models, not Qwen2), else by the probe's log-probs (weights/probe.py) where given."""

    def __init__(self, servers):
        self.servers = servers  # what it needs: urls, live, post(i, path, body, timeout), dialect(i)
        self.no_rows: set[int] = set()
        self.no_checksum: set[int] = set()
        self.before: dict[int, ServerChecksums] = {}
        self.said: set[int] = set()  # servers said to be unverified
        self.hash_dtype: dict[int, torch.dtype | None] = {}  # the dtype each server's checksums agree in
        self.seconds = 0.0

    @property
    def unverified(self) -> set[int]:
        return self.no_rows & self.no_checksum

    def forget(self, servers: list[int]) -> None:
        """Servers taken back (perhaps restarted): asked afresh, nothing compared with before."""
        for i in servers:
            self.no_rows.discard(i)
            self.no_checksum.discard(i)
            self.before.pop(i, None)
            self.said.discard(i)
            self.hash_dtype.pop(i, None)

    def run(self, weights: TrainerWeights, version: int, served: torch.dtype | None, when: str | None = None,
            scores: Scores | None = None, prev_scores: Scores | None = None) -> None:
        """Raise WeightMismatch naming the first server found not to hold `weights`; say in one line
        each server no check can decide for. `scores`, `prev_scores`: the trainer's log-probs of the
        probe under these weights and the previous push's (weights/probe.py), for servers the exact
        checks do not reach."""
        import time

        from rlrecipe.core.console import console

        t0 = time.perf_counter()
        when = when or f"after the update to weight version {version}"
        trainer_sums: dict[tuple, dict] = {}  # the trainer's tensors by names, their checksums by names and dtype
        rows = None
        # every server hashes its own weights: asked side by side, not one after another
        ask = [i for i in self.servers.live if i not in self.no_checksum]
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(ask)))) as pool:
            answers = dict(zip(ask, pool.map(self._checksums, ask), strict=True))
        for i in list(self.servers.live):
            url = self.servers.urls[i]
            undecided = None  # why no check decided for server i
            # the dtype the server says it serves (an attached one may differ from rollout.dtype)
            dtype = stated_dtype(self.servers.server_info(i)) or served
            if i not in self.no_rows:
                if rows is None:
                    rows = weights.read(sample_names(weights.shapes(), version), TRUNCATE_ROWS)
                self._check_rows(i, rows, dtype, when)
            answer = answers.get(i)
            if answer is not None:
                names = checksum_names(weights.shapes(), set().union(*answer))
                ours = self._trainer_sums(i, weights, names, answer[0], dtype, trainer_sums)
                before = self.before.get(i)
                verdict, detail = judge(answer, ours, before, hashes_on_cpu(self.servers.server_info(i)))
                if verdict == "stale":
                    raise WeightMismatch(f"SGLang server {url}: {when}, it still serves the weights of version "
                                         f"{before.version} ({detail})")
                if verdict == "wrong":
                    raise WeightMismatch(f"SGLang server {url}: {when}, its weights are not the trainer's ({detail})")
                if verdict == "ok" or (verdict == "undecided" and before is None):
                    self.before[i] = ServerChecksums(answer, ours, version)
                if verdict == "undecided" and i in self.no_rows:
                    undecided = detail
            elif i in self.no_rows:
                undecided = (f"it answers neither /weights_checker checksums nor /get_weights_by_name for this "
                             f"model ({self.servers.dialect(i).label()})")
            if undecided is not None and scores is not None:
                undecided = self._probe(i, scores, prev_scores, when)
            if undecided is not None and (scores is not None or i not in self.said):
                self.said.add(i)  # without the probe, what cannot be checked is said once, not at every push
                console.print(f"[yellow]warning[/]: SGLang server {url}: {when}, its weights cannot be verified: "
                              f"{undecided}", highlight=False, soft_wrap=True)
        self.seconds = time.perf_counter() - t0

    def run_probe(self, version: int, scores: Scores | None, prev: Scores | None, when: str | None = None) -> None:
        """The probe alone on every live server (an adapter push: the base weights, which the exact
        checks read, did not move); raise WeightMismatch at the first that fails, say which cannot
        be decided."""
        import time

        from rlrecipe.core.console import console

        t0 = time.perf_counter()
        when = when or f"after the update to weight version {version}"
        for i in list(self.servers.live):
            undecided = ("no probe log-probs were given for this version" if scores is None
                         else self._probe(i, scores, prev, when))
            if undecided is not None:
                console.print(f"[yellow]warning[/]: SGLang server {self.servers.urls[i]}: {when}, its adapter cannot "
                              f"be verified: {undecided}", highlight=False, soft_wrap=True)
        self.seconds = time.perf_counter() - t0

    def _probe(self, i: int, scores: Scores, prev: Scores | None, when: str) -> str | None:
        """The check through generation (weights/probe.py): None when it decided and the server passed."""
        try:
            got = server_scores(self.servers, i, scores)
        except AdapterRefused as err:
            raise WeightMismatch(f"SGLang server {self.servers.urls[i]}: {when}, it refuses the probe under adapter "
                                 f"{self.servers.adapter} ({err})") from None
        if got is None:
            return "it gives no input_token_logprobs for the probe either"
        verdict, detail = judge_scores(got, scores, prev)
        url = self.servers.urls[i]
        if verdict == "stale":
            raise WeightMismatch(f"SGLang server {url}: {when}, it still serves the weights of version {prev.version} "
                                 f"(its log-probs of the probe are {detail})")
        if verdict == "wrong":
            raise WeightMismatch(f"SGLang server {url}: {when}, its weights are not the trainer's ({detail})")
        return None if verdict == "ok" else f"by the probe's log-probs, {detail}"

    def _trainer_sums(self, i: int, weights: TrainerWeights, names: list[str], rank0: dict[str, str],
                      served: torch.dtype | None, cache: dict) -> dict[str, str]:
        """The trainer's checksums of `names`, cast as server i holds its weights: the served dtype
        (rollout.dtype), or the dtype under which its checksums first agreed with the trainer's. An
        attached server may hold another dtype than the recipe says; a server that hashes otherwise
        (on a GPU) is tried once."""
        tried = [self.hash_dtype.get(i, served)]
        if i not in self.hash_dtype:
            tried += [d for d in (torch.float32, torch.bfloat16, torch.float16) if d not in tried]
        if tuple(names) not in cache:
            cache[tuple(names)] = weights.read(names)
        for dtype in tried:
            key = (tuple(names), dtype)
            if key not in cache:
                cache[key] = {n: served_checksum(n, t.to(dtype) if dtype is not None else t)
                              for n, t in cache[tuple(names)].items()}
            if any(rank0.get(n) == h for n, h in cache[key].items()):
                self.hash_dtype[i] = dtype
                return cache[key]
        self.hash_dtype.setdefault(i, served)
        return cache[(tuple(names), tried[0])]

    def _checksums(self, i: int) -> list[dict[str, str]] | None:
        """Server i's per-rank checksums; None (and not asked again) where it has none."""
        if not self.servers.dialect(i).weights_checksum:
            self.no_checksum.add(i)
            return None
        r = self.servers.post(i, "/weights_checker", {"action": "checksum"}, timeout=(30.0, 600.0))
        ranks = rank_checksums(r.json()) if r.status_code == 200 else None
        if ranks is None:
            self.no_checksum.add(i)
        return ranks

    def _check_rows(self, i: int, expected: dict[str, torch.Tensor], served: torch.dtype | None, when: str) -> None:
        rows = max((t.shape[0] for t in expected.values() if t.dim()), default=TRUNCATE_ROWS)
        for name, exp in expected.items():
            r = self.servers.post(i, "/get_weights_by_name", {"name": name, "truncate_size": rows},
                                  timeout=(30.0, 300.0))
            if r.status_code != 200:  # SGLang implements it for a few architectures only
                self.no_rows.add(i)
                return
            problem = compare(exp, r.json(), served)
            if problem is not None:
                raise WeightMismatch(f"SGLang server {self.servers.urls[i]}: {when}, parameter {name} (first {rows} "
                                     f"rows) is not the trainer's: {problem}")
