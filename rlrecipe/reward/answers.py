r"""Answers without math-verify: the last ``\boxed{...}`` of a response, and the exact fast path.

Everything here runs in the calling process and in time linear in the input, so a response can
be graded cheaply wherever math-verify's verdict is certain without running it.
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
#
# The fast path answers only where it knows math-verify's answer: both the answer and a reference
# are, character for character, one of the forms below, whose parse math-verify's configs fix (an
# integer, an exact rational, a decimal number, a single letter). Nothing is cleaned up first: a
# trailing "." or a \text{} wrapper changes math-verify's parse, so any other writing goes to it.

_INT = re.compile(r"^([+-]?)([0-9]+)$")
_MAX_INT_CHARS = 400  # far below Python's 4,300-digit int() limit, past which math-verify fails to parse
# A plain number: a sign, then 12.5 / .5 / 3/4 / \frac{3}{4} (also \dfrac, \tfrac) / \frac34.
_NUMBER = re.compile(
    r"^(?P<sign>[+-]?)(?:"
    r"(?P<whole>[0-9]*)\.(?P<decimals>[0-9]+)"
    r"|(?P<num>[0-9]+)/(?P<den>[0-9]+)"
    r"|\\[dt]?frac\{(?P<fnum>[0-9]+)\}\{(?P<fden>[0-9]+)\}"
    r"|\\[dt]?frac(?P<dnum>[0-9])(?P<dden>[0-9])"
    r")$")
_MAX_NUMBER_CHARS = 64  # longer ones are left to math-verify
# math-verify compares a decimal with another number after rounding both to 6 places (so that
# 0.333333 counts as 1/3), through 15-digit floats. Only a gap wider than any rounding can close,
# between numbers small enough for those floats, is certainly "different" to it; and equal values
# are certainly "equal" to it where they have at most 6 decimal places (rounding changes neither).
_DECIMAL_GAP = Fraction(1, 10**5)
_DECIMAL_RANGE = 10**6
_DECIMAL_PLACES = 10**6
# A single letter, a choice (B) or a variable: math-verify reads it as a symbol, equal to the same
# letter in either case (b == B) and to nothing else; but e (Euler's number to it: e == 2.718281828)
# and i (the imaginary unit: i != I) are left to it.
_LETTER = re.compile(r"^[A-DF-HJ-Za-df-hj-z]$")

_Value = tuple[str, Any]  # ("int", (sign, digits)) / ("number", (Fraction, has a decimal point)) / ("letter", str)


def _unboxed(s: str) -> str:
    r"""What a worker boxes to parse `s`: ``\boxed{70}`` is parsed as it stands, and ``70`` as
    ``\boxed{70}``, so a reference written ``\boxed{70}`` is read here as ``70``."""
    if s.startswith("\\boxed{") and s.endswith("}") and "\\boxed" not in s[7:]:
        return s[7:-1]
    return s


def _value(s: str) -> _Value | None:
    """The form `s` is written in (exactly, no spaces) and its value; None for any other form."""
    s = _unboxed(s)
    m = _INT.match(s)
    if m and len(s) <= _MAX_INT_CHARS:
        digits = m.group(2).lstrip("0") or "0"  # no int(), so no digit limit either
        return "int", ("-" if m.group(1) == "-" and digits != "0" else "", digits)
    if len(s) <= _MAX_NUMBER_CHARS:
        m = _NUMBER.match(s)
        if m:
            g = m.groupdict()
            if g["decimals"] is not None:
                value = Fraction(int((g["whole"] or "0") + g["decimals"]), 10 ** len(g["decimals"]))
                decimal = True
            else:
                num, den = next((g[n], g[d]) for n, d in (("num", "den"), ("fnum", "fden"), ("dnum", "dden"))
                                if g[n] is not None)
                if int(den) == 0:
                    return None  # 1/0 is no number; math-verify has its own view of it
                value, decimal = Fraction(int(num), int(den)), False
            return "number", (-value if g["sign"] == "-" else value, decimal)
    if _LETTER.match(s):
        return "letter", s.lower()
    return None


def _as_number(v: _Value) -> tuple[Fraction, bool] | None:
    if v[0] == "number":
        return v[1]
    if v[0] == "int" and len(v[1][1]) <= _MAX_NUMBER_CHARS:
        return Fraction(int(v[1][0] + v[1][1])), False
    return None


def _same(x: _Value, ref: _Value) -> bool | None:
    """math-verify's verdict on answer `x` against reference `ref`; None when not certain."""
    if (x[0] == "letter") != (ref[0] == "letter"):
        return False  # a letter and a number
    if x[0] == "letter":
        return x[1] == ref[1]
    if x[0] == "int" and ref[0] == "int":
        return x[1] == ref[1]  # exact integers, of any length up to _MAX_INT_CHARS
    a, b = _as_number(x), _as_number(ref)
    if a is None or b is None:
        return None
    (va, a_decimal), (vb, b_decimal) = a, b
    if not (a_decimal or b_decimal):
        return va == vb  # exact rationals, compared exactly
    if max(abs(va), abs(vb)) >= _DECIMAL_RANGE:
        return None
    if va == vb:
        return True if (va * _DECIMAL_PLACES).denominator == 1 else None
    return False if abs(va - vb) > _DECIMAL_GAP else None


def fast_grade(extracted: str, answers: list[str]) -> bool | None:
    r"""math-verify's verdict where it is certain without math-verify; None where it must decide.

    Decided here, and only on these exact forms of both the answer and a reference (a reference
    may also be boxed: ``\boxed{70}``): integers (``070 == 70``, ``+7 == 7``); exact rationals
    (``1/2``, ``\frac{1}{2}``, ``\dfrac12``, equal by value: ``\frac{10}{2} == 5``); decimals
    (``0.5 == \frac{1}{2}``) where math-verify's rounding to 6 places cannot decide otherwise;
    single letters (``b == B``, never equal to a number; not ``e`` or ``i``). Correct when one
    reference is certainly equal, wrong when every reference is certainly different; anything
    else (``70.``, ``\text{70}``, ``1,000``, ``x=5``, ``\sqrt{2}``) is math-verify's to decide.
    """
    x = _value(extracted)
    if x is None:
        return None
    verdicts = [None if r is None else _same(x, r) for r in map(_value, answers)]
    if True in verdicts:
        return True
    if verdicts and all(v is False for v in verdicts):
        return False
    return None
