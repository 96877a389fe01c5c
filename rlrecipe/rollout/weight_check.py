"""After each weight push, do the servers hold what the trainer sent? A fingerprint of a few parameters.

An update that answers 200 says the server ran its load, not that the weights it serves are the
trainer's (a wrong file read, a shard mapped to the wrong place, a load that silently skipped). So
after every push the engine asks each server for the first rows of a few parameters with SGLang's
`/get_weights_by_name` ({"name": HF parameter name, "truncate_size": rows} -> the parameter's
first `truncate_size` rows along dim 0, as float32 nested lists; with dp_size > 1, one such list
per replica) and compares them with the trainer's, cast as the server holds them.

Which parameters: a different handful each version (seeded by it), always the final norm, only
ones of at most MAX_NUMEL elements: SGLang converts the whole parameter to a Python list before it
truncates, which for a 7B model's embedding (545M values) would take minutes and tens of GB.

Tolerance: the trainer's tensor is cast to the served dtype before comparing, so a faithful load
matches to within one unit in the last place of the coarser of the two dtypes (casts by another
route, e.g. fp32 -> bf16 -> fp16, can differ by that much). A stale server one step behind can
fall inside that tolerance in bf16 (one step's update is often below bf16's resolution); the
weight_version every answer carries catches that. Weights that are not the trainer's do not.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from rlrecipe.core.errors import UserError

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


def state_slices(state: dict[str, torch.Tensor], version: int, rows: int = TRUNCATE_ROWS) -> dict[str, torch.Tensor]:
    """The sampled parameters' first rows from an in-memory state dict (the broadcast push)."""
    from rlrecipe.rollout.weight_sync import distinct_tensors

    named = dict(distinct_tensors(state))
    names = sample_names({n: tuple(t.shape) for n, t in named.items()}, version)
    return {n: named[n].detach()[:rows].to("cpu", copy=True) for n in names}


def export_slices(model_dir: str | Path, version: int, rows: int = TRUNCATE_ROWS) -> dict[str, torch.Tensor]:
    """The sampled parameters' first rows read from an HF safetensors export (the disk push): only
    those rows are read."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    where, shapes = {}, {}
    for f in files:
        with safe_open(model_dir / f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                where[name] = f
                shapes[name] = tuple(st.get_slice(name).get_shape())
    out = {}
    for name in sample_names(shapes, version):
        with safe_open(model_dir / where[name], framework="pt") as st:
            out[name] = st.get_slice(name)[:rows]
    return out


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


def check_servers(engine, expected: dict[str, torch.Tensor], version: int, served: torch.dtype | None,
                  when: str | None = None) -> None:
    """Ask each of the engine's live servers for the `expected` rows; raise WeightMismatch naming the
    server and the parameter where they differ (`when`: how the error says when; by default after
    the update to `version`). A server that does not answer /get_weights_by_name (an SGLang model
    without it) is said once and not asked again."""
    when = when or f"after the update to weight version {version}"
    from rlrecipe.core.console import console

    rows = max((t.shape[0] for t in expected.values() if t.dim()), default=TRUNCATE_ROWS)
    for i in list(engine.live):
        if i in engine.no_weight_check:
            continue
        for name, exp in expected.items():
            r = engine.post(i, "/get_weights_by_name", {"name": name, "truncate_size": rows}, timeout=(30.0, 300.0))
            if r.status_code != 200:
                engine.no_weight_check.add(i)
                console.print(f"[yellow]warning[/]: SGLang server {engine.urls[i]} does not answer /get_weights_by_name "
                              f"for {name} (HTTP {r.status_code}: {r.text[:200]}); its weights are not verified "
                              "after updates", highlight=False, soft_wrap=True)
                break
            problem = compare(exp, r.json(), served)
            if problem is not None:
                raise WeightMismatch(f"SGLang server {engine.urls[i]}: {when}, parameter {name} (first {rows} rows) "
                                     f"is not the trainer's: {problem}")
