"""Markdown pieces of the generated RESULTS.md: cells, tables, wrapped paragraphs, numbers."""

from __future__ import annotations

import math
import textwrap
from typing import Any


def cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def wrapped(paragraph: str) -> str:
    """A generated paragraph in lines of at most 100 characters, as the rest of the file."""
    return textwrap.fill(paragraph, width=100, break_long_words=False, break_on_hyphens=False) + "\n"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def num(x: Any, fmt: str) -> str:
    """A number in `fmt`; "-" for a missing one (None, not a number, NaN or inf)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return "-"
    return format(x, fmt)


def mean_sd(mean: Any, sd: Any, fmt: str) -> str:
    return num(mean, fmt) + (f" ± {num(sd, fmt)}" if sd is not None else "")
