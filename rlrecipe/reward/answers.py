r"""Answers without math-verify: the last ``\boxed{...}`` of a response, and the exact fast path.

Everything here runs in the calling process and in time linear in the input, so a response can
be graded cheaply whenever equality is certain without a computer-algebra system.
"""

from __future__ import annotations

import re
from fractions import Fraction
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


# A plain number after normalisation: a sign, then 12 / 12.5 / .5 / 3/4 / \frac{3}{4} / \frac34.
_NUMBER = re.compile(
    r"^(?P<sign>[+-]?)(?:"
    r"(?P<whole>\d*)\.(?P<decimals>\d+)"
    r"|(?P<int>\d+)"
    r"|(?P<num>\d+)/(?P<den>\d+)"
    r"|\\frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\}"
    r"|\\frac(?P<dnum>\d)(?P<dden>\d)"
    r")$")
_MAX_NUMBER_CHARS = 64  # longer numbers are left to the integer rule above or to math-verify
# math-verify compares a decimal with another number after rounding both to 6 places (so that
# 0.333333 counts as 1/3), through 15-digit floats: only a gap wider than any rounding can close,
# between numbers small enough for those floats, is certainly "different" to it.
_DECIMAL_GAP = Fraction(1, 10**5)
_DECIMAL_RANGE = 10**6
# Exact fractions it compares by evaluating their difference to 15 digits: a relative gap this
# wide survives that.
_RELATIVE_GAP = Fraction(1, 10**9)


def _as_number(s: str) -> tuple[Fraction, bool] | None:
    """A plain number as (its exact value, written with a decimal point); None for anything else."""
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    m = _NUMBER.match(s)
    if not m:
        return None
    g = m.groupdict()
    if g["decimals"] is not None:
        value, decimal = Fraction(int((g["whole"] or "0") + g["decimals"]), 10 ** len(g["decimals"])), True
    elif g["int"] is not None:
        value, decimal = Fraction(int(g["int"])), False
    else:
        num, den = next((g[n], g[d]) for n, d in (("num", "den"), ("fnum", "fden"), ("dnum", "dden"))
                        if g[n] is not None)
        if int(den) == 0:
            return None  # 1/0 is no number; math-verify has its own view of it
        value, decimal = Fraction(int(num), int(den)), False
    return (-value if g["sign"] == "-" else value), decimal


def _surely_apart(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    """Two unequal numbers that math-verify would also call different."""
    (va, a_decimal), (vb, b_decimal) = a, b
    gap, size = abs(va - vb), max(abs(va), abs(vb))
    if a_decimal or b_decimal:
        return gap > _DECIMAL_GAP and size < _DECIMAL_RANGE
    return gap > size * _RELATIVE_GAP


# A single letter: a choice of a multiple-choice question (B), or a variable. math-verify reads
# one as a symbol, equal to the same letter in either case (b == B) and to nothing else, but for
# e (Euler's number: e == 2.718281828) and i (the imaginary unit), which are left to it.
_LETTER = re.compile(r"^[A-DF-HJ-Za-df-hj-z]$")


def _as_letter(s: str) -> str | None:
    return s.lower() if _LETTER.match(s) else None


def fast_grade(extracted: str, answers: list[str]) -> bool | None:
    r"""True/False when decidable without math-verify; None when math-verify must decide.

    Decided here: equal strings after `normalize_answer`; plain integers (``070 == 70``); plain
    numbers (integers, decimals, ``a/b``, ``\frac{a}{b}``) equal as exact rationals
    (``0.5 == \frac{2}{4}``); single letters, as math-verify compares them (``b == B``, and
    never equal to a number). Wrong only when every reference is a number or letter that
    math-verify, too, would find different; anything else (``x=5``, ``1,000``, ``\sqrt{2}``,
    ``50\%``, ``e``) is math-verify's to decide.
    """
    x = normalize_answer(extracted)
    refs = [normalize_answer(a) for a in answers]
    if x and x in refs:
        return True
    xi = _as_int(x)
    if xi is not None:
        ref_ints = [_as_int(r) for r in refs]
        if any(ri == xi for ri in ref_ints):
            return True
        if all(ri is not None for ri in ref_ints):
            return False
    xn, xl = _as_number(x), _as_letter(x)
    if xn is None and xl is None:
        return None
    ref_numbers, ref_letters = [_as_number(r) for r in refs], [_as_letter(r) for r in refs]
    if xn is not None and any(rn is not None and rn[0] == xn[0] for rn in ref_numbers):
        return True
    if xl is not None and xl in ref_letters:
        return True

    def apart(rn: tuple[Fraction, bool] | None, rl: str | None) -> bool:
        """x and this reference are different to math-verify too: numbers surely apart, a
        number and a letter, or two different letters."""
        if rn is not None:
            return xl is not None or _surely_apart(xn, rn)
        return rl is not None and (xn is not None or rl != xl)

    if all(apart(rn, rl) for rn, rl in zip(ref_numbers, ref_letters, strict=True)):
        return False
    return None
