"""Slurm's compact host lists ("gpu[01-03,07],login2") expanded as `scontrol show hostnames` does,
so a node can name the job's first host without Slurm's tools on its PATH."""

from __future__ import annotations

import re

from rlrecipe.core.errors import UserError


def _split_top(text: str) -> list[str]:
    """Comma-separated items, commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth < 0:
            raise UserError(f"SLURM_JOB_NODELIST={text!r}: a ']' without its '['")
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise UserError(f"SLURM_JOB_NODELIST={text!r}: a '[' without its ']'")
    items.append(text[start:])
    return [x for x in items if x]


def _expand(item: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"SLURM_JOB_NODELIST: {item!r}: {part!r} is not a number or a range of numbers")
        for n in range(int(lo), int(hi or lo) + 1):
            out += [prefix + str(n).zfill(len(lo)) + tail for tail in _expand(rest)]  # zero padding kept
    return out


def expand_nodelist(text: str) -> list[str]:
    hosts = [h for item in _split_top(text.strip()) for h in _expand(item)]
    if not hosts:
        raise UserError("SLURM_JOB_NODELIST is empty: run the node command inside a Slurm job (or set it)")
    return hosts
