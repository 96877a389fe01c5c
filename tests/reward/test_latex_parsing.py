r"""The grading workers' faster latex2sympy parsing gives exactly latex2sympy's own results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sympy

from rlrecipe.reward import latex_parsing
from tests.reward.test_reward import APART_STRINGS

DATA = Path(__file__).parents[1] / "data"

# Numbers in every form latex2sympy reads, and malformed answers whose exception must stay the same.
EDGE_STRINGS = ["0", "00", "007", "1,000", "1,000,000", "0,5", "3.14", ".5", "1e5", "2.5\\times10^{3}",
                "123456789012345678901234567890", "-42", "+7", "１２", "٣", "10\\%", "1,5\\%", "x_{10}",
                "2^{10}", "\\frac{010}{2}", "\\sqrt[3]{0027}", "\\{1,2,3\\}", "(0,1]", "3 \\cdot 4", "4!",
                "\\frac{1}{", "}{", "", "\\sqrt", "x=", "1+", "\\frac{a}{b}=", "\\begin{pmatrix}1&2\\end{pmatrix}",
                "\\log_{10} 1000", "\\binom{10}{3}", "12 \\text{ apples}", "\\$5", "5^\\circ", "x^2+2x+1"]


def corpus() -> list[str]:
    """Answers of every shape, AReaL's real references and responses, AIME 2025's answers and
    MATH-500's 500 references (tests/data/README.md)."""
    from rlrecipe.reward import extract_boxed

    out = [*APART_STRINGS, *EDGE_STRINGS]
    for line in (DATA / "boba_reward_cases.jsonl").read_text(encoding="utf-8").splitlines():
        case = json.loads(line)
        out += [extract_boxed(s) or s for s in case["solutions"]]
        out += [b for b in (extract_boxed(g) for g in case["generateds"]) if b]
    for line in (DATA / "aime25_test.jsonl").read_text(encoding="utf-8").splitlines():
        out.append(str(json.loads(line)["answer"]))
    for line in (DATA / "math500_answers.jsonl").read_text(encoding="utf-8").splitlines():
        out.append(json.loads(line)["answer"])
    out += [f"{a}\\sqrt{{{b}}}" for a in (1, 7, 40) for b in (2, 12, 300)]
    out += [f"\\frac{{{a}}}{{{b}}}" for a in (0, 3, 250) for b in (1, 4, 1000)]
    return list(dict.fromkeys(out))


# Run in a fresh interpreter: ANTLR's prediction cache is shared by all parses in a process, so each
# side converts the corpus without the other having warmed it.
CONVERT = r"""
import json, os, sys
from sympy import srepr
from latex2sympy2_extended import latex2sympy
from rlrecipe.reward import latex_parsing
from rlrecipe.reward.worker import _parse
import rlrecipe.reward.worker as w
w._mv()  # installs the patches
if os.environ["PATCHED"] != "1":
    latex_parsing.uninstall()
def shown(fn, s):
    try:
        r = fn(s)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    return [x if isinstance(x, str) else srepr(x) for x in r] if isinstance(r, list) else srepr(r)
out = {s: [shown(latex2sympy, s), shown(_parse, s)] for s in json.load(sys.stdin)}
print(json.dumps({"installed": latex_parsing.installed(), "out": out}))
"""


def convert_all(strings: list[str], patched: bool) -> dict:
    env = {**os.environ, "PATCHED": "1" if patched else "0"}
    done = subprocess.run([sys.executable, "-c", CONVERT], input=json.dumps(strings), capture_output=True,
                          text=True, env=env, check=True, timeout=600)
    return json.loads(done.stdout)


def test_same_results_as_latex2sympy_on_every_answer_shape_and_real_answers():
    strings = corpus()
    assert len(strings) > 450
    plain, fast = convert_all(strings, patched=False), convert_all(strings, patched=True)
    assert (plain["installed"], fast["installed"]) == (False, True)
    raised = [s for s, (direct, _) in plain["out"].items() if direct.startswith("raised")]
    assert len(raised) >= 5  # the malformed ones above, whose errors must stay the same too
    for s in strings:
        assert fast["out"][s] == plain["out"][s], s


def test_number_literals_are_the_numbers_latex2sympy_builds():
    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy

    assert latex_parsing.install()
    converter, original = _Latex2Sympy(), latex_parsing._originals["parse_number"]

    def built(fn, text):
        try:
            value = fn(converter, text)
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}"
        return type(value), sympy.srepr(value)

    for text in ["0", "7", "0007", "1,000", "98765432109876543210", "2.50", "1e5", "１２", "٣", "1x"]:
        assert built(_Latex2Sympy.parse_number, text) == built(original, text), text
    assert type(converter.parse_number("0007")) is sympy.Integer  # built directly, not via a string parse


def test_a_failed_fast_parse_is_done_again_as_latex2sympy_does(monkeypatch):
    """Whatever goes wrong under SLL prediction, the answer is parsed again the original way."""
    from antlr4.atn.PredictionMode import PredictionMode
    from latex2sympy2_extended import latex2sympy
    from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy

    assert latex_parsing.install()
    modes = []
    inner = latex_parsing._originals["parse"]

    def flaky(self, latex_str):
        parser = self.create_parser(latex_str)
        modes.append((parser._interp.predictionMode, type(parser._errHandler).__name__))
        if parser._interp.predictionMode == PredictionMode.SLL:
            raise Exception("as if SLL reported a syntax error")  # noqa: TRY002
        return inner(self, latex_str)

    monkeypatch.setitem(latex_parsing._originals, "parse", flaky)
    assert latex2sympy("\\frac{3}{4}") == sympy.Rational(3, 4)
    assert modes == [(PredictionMode.SLL, "BailErrorStrategy"), (PredictionMode.LL, "DefaultErrorStrategy")]
    assert _Latex2Sympy.parse is not flaky  # the installed wrapper, calling the original through the table
