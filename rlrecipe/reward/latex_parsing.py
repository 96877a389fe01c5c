r"""Two changes to how latex2sympy parses an answer that make it faster and keep its result.

math-verify turns every LaTeX answer into sympy through latex2sympy2_extended; on a grading worker
that parsing was most of an answer's cost (about 1.3 ms a parse, twice per answer: once for the
answer, once for its reference, of 2.7 ms in all). Two of its causes are not the work itself:

1. **Integer literals go through sympy's expression parser.** latex2sympy builds each number with
   ``sympy.Number(text)``, which sympifies the string; sympy's `parse_expr` then runs
   ``from sympy import *`` into a fresh namespace on every call (about 0.3 ms, a third of parsing
   ``9\sqrt{2}``). For a string of ASCII digits that is ``sympy.Integer(text)``, built directly here.
   Anything else (decimals, exponents, non-ASCII digits) still goes to latex2sympy's own code.
2. **ANTLR's full-context (LL) prediction and error recovery, on input that needs neither.**
   ANTLR documents that a parse in SLL mode either returns the very tree LL would, or reports a
   syntax error, and recommends two stages: SLL prediction with the bail-out error strategy
   (no per-subrule recovery checks; the first error aborts), and, on any error, the parse again
   in LL with the default strategy. latex2sympy's top rule ends in EOF, so a first stage that
   returns has matched the whole answer without error. Here the whole conversion is tried once
   that way and, if anything at all is raised, done again exactly as before; the exception a bad
   answer gets is the original one. It saves about 0.5 ms a parse.

Both patch latex2sympy's converter class in the process that calls `install()` (the grading
workers do, in `rlrecipe.reward.worker._mv`). tests/test_latex_parsing.py compares every answer
and reference in tests/data and a list of answers of every shape, converted with and without them,
in two fresh interpreters, so a change in either library that breaks the equivalence shows.
"""

from __future__ import annotations

_originals: dict | None = None


def install() -> bool:
    """Patch latex2sympy's converter (idempotent). False, and nothing changed, where its converter
    does not have the shape these patches were written against."""
    global _originals
    if _originals is not None:
        return True
    try:
        import sympy
        from antlr4.atn.PredictionMode import PredictionMode
        from antlr4.error.ErrorStrategy import BailErrorStrategy
        from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
    except ImportError:
        return False
    if not all(callable(getattr(_Latex2Sympy, name, None)) for name in ("parse", "create_parser", "parse_number")):
        return False
    originals = {name: getattr(_Latex2Sympy, name) for name in ("parse", "create_parser", "parse_number")}

    def parse_number(self, text):
        digits = text.replace(",", "")  # as latex2sympy does: 1,000 is 1000
        if digits.isascii() and digits.isdigit():
            return sympy.Integer(digits)  # leading zeros are ignored by int(), as latex2sympy strips them
        return originals["parse_number"](self, text)

    def create_parser(self, latex_str):
        parser = originals["create_parser"](self, latex_str)
        if getattr(self, "_rlrecipe_sll", False):
            parser._interp.predictionMode = PredictionMode.SLL
            parser._errHandler = BailErrorStrategy()
        return parser

    def parse(self, latex_str):
        self._rlrecipe_sll = True
        try:
            return originals["parse"](self, latex_str)
        except Exception:  # noqa: BLE001 - any failure: parse again exactly as latex2sympy does
            pass
        finally:
            self._rlrecipe_sll = False
        return originals["parse"](self, latex_str)

    _Latex2Sympy.parse_number = parse_number
    _Latex2Sympy.create_parser = create_parser
    _Latex2Sympy.parse = parse
    _originals = originals
    return True


def uninstall() -> None:
    """Restore latex2sympy's own methods (for comparisons and benchmarks)."""
    global _originals
    if _originals is None:
        return
    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy

    for name, fn in _originals.items():
        setattr(_Latex2Sympy, name, fn)
    _originals = None


def installed() -> bool:
    return _originals is not None
