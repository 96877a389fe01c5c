r"""Answers without math-verify: the last ``\boxed{...}`` of a response, and the exact fast path.

Everything here runs in the calling process and in time linear in the input, so a response can
be graded cheaply whenever equality is certain without a computer-algebra system.
"""

from __future__ import annotations

import re
from typing import Any

# -- extraction -----------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.S)  # an escape (\{ \} \\ ...) or a grouping brace
_BARE_TOKEN = re.compile(r"[^\s$]+")
_WS = " \t\r\n"


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed x``.

    None when there is no box, the last box is unbalanced (e.g. a truncated response) or empty.
    Escaped braces ``\{ \}`` do not count. Runs in time linear in ``len(text)``.
    """
    if not text:
        return None
    # Next candidate position for each command, searched backwards; each command's search
    # only ever moves left, so the scan is linear however many false candidates (\fboxsep) occur.
    pos = {cmd: text.rfind(cmd) for cmd in _BOX_COMMANDS}
    while True:
        cmd = max(pos, key=lambda c: pos[c])
        start = pos[cmd]
        if start < 0:
            return None
        j = start + len(cmd)
        if j < len(text) and text[j].isalpha():  # a longer command name, e.g. \fboxsep
            pos[cmd] = text.rfind(cmd, 0, start)
            continue
        break
    k = j
    while k < len(text) and text[k] in _WS:
        k += 1
    if k >= len(text):
        return None
    if text[k] == "{":
        depth = 0
        for m in _BRACE_TOKENS.finditer(text, k):
            tok = m.group()
            if tok == "{":
                depth += 1
            elif tok == "}":
                depth -= 1
                if depth == 0:
                    content = text[k + 1:m.start()].strip()
                    return content or None
        return None  # unbalanced
    if cmd != "\\boxed":
        return None  # \fbox needs braces
    m = _BARE_TOKEN.match(text, k)  # `\boxed 70` / `\boxed5`
    content = m.group().rstrip(".,;:") if m else ""
    return content or None


def answer_list(answers: Any) -> list[str]:
    """Reference answers as non-empty strings; a single answer may come bare."""
    if answers is None:
        return []
    if isinstance(answers, (str, int, float)):
        answers = [answers]
    return [str(a) for a in answers if a is not None and str(a).strip()]


# -- fast path ------------------------------------------------------------------------------

_WRAPPER = re.compile(r"^\\(?:text|textbf|textrm|mathrm|mathbf|mbox|boxed)\s*\{(.*)\}$", re.S)
_DROP = re.compile(r"\\left|\\right|\\[,;:! ]|\$|\s+")
_INT = re.compile(r"^([+-]?)(\d+)$")


def normalize_answer(s: str) -> str:
    r"""Light, meaning-preserving normalisation used only to decide equality cheaply."""
    s = s.strip()
    for _ in range(4):
        m = _WRAPPER.match(s)
        if not m or not _balanced(m.group(1)):
            break
        s = m.group(1).strip()
    s = _DROP.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _balanced(s: str) -> bool:
    depth = 0
    for m in _BRACE_TOKENS.finditer(s):
        depth += {"{": 1, "}": -1}.get(m.group(), 0)
        if depth < 0:
            return False
    return depth == 0


def _as_int(s: str) -> tuple[str, str] | None:
    """A plain integer as (sign, digits without leading zeros); no int() so no digit limit."""
    m = _INT.match(s)
    if not m:
        return None
    digits = m.group(2).lstrip("0") or "0"
    return ("" if digits == "0" or m.group(1) != "-" else "-", digits)


def fast_grade(extracted: str, answers: list[str]) -> bool | None:
    """True/False when decidable without math-verify; None when math-verify must decide."""
    x = normalize_answer(extracted)
    refs = [normalize_answer(a) for a in answers]
    if x and x in refs:
        return True
    xi = _as_int(x)
    if xi is None:
        return None
    ref_ints = [_as_int(r) for r in refs]
    if any(ri == xi for ri in ref_ints):
        return True
    if all(ri is not None for ri in ref_ints):
        return False
    return None
