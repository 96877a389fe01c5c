r"""A corpus of (response, reference answers) pairs, and math-verify's own verdicts on them.

The pairs are built in code from real answer forms: AIME 2025's integers (and others) with
leading zeros, MATH-500's 500 references, AReaL's boba references and model responses
(tests/data/README.md), fractions, decimals, radicals, intervals, sets, units, ``\text``,
thousands separators, trailing punctuation, full-width characters, single letters, malformed
LaTeX, and responses with several, nested or empty boxes. Each answer is written in many ways
(the ways models write it, and the clean-ups a grader might be tempted to make), against its
own reference and against near and far wrong ones.

`reference_verdicts` grades them with nothing but math-verify, in fresh interpreters that never
import this project (so none of its patches or shortcuts are in play): the verdict the grader
promises is math-verify's `verify(parse(reference), parse(answer))`, each side boxed as
`rlrecipe.reward.worker` boxes it, with the same extraction configs, true when any reference
matches; a response with no (or an empty, or an unbalanced) last box, or no reference, is wrong.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from rlrecipe.reward.grader import GRADER_HASH_SEED

DATA = Path(__file__).parent / "data"

FULL_WIDTH = str.maketrans("0123456789+-/.,()", "０１２３４５６７８９＋－／．，（）")


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def _thousands(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def integer_forms(n: int, rng: random.Random) -> list[str]:
    """One integer written the ways responses write it (and a grader might clean up)."""
    s = str(n)
    forms = [s, s.zfill(3), "0" + s, "+" + s, f"\\text{{{s}}}", f"\\textbf{{{s}}}", f"\\mathbf{{{s}}}",
             f"\\mathrm{{{s}}}", f"\\mbox{{{s}}}", f"{s}.", f"{s},", f"{s};", f"${s}$", f"{{{s}}}",
             f"({s})", f"\\left({s}\\right)", f"{s}.0", f"{s}.00", f"\\frac{{{2 * n}}}{{2}}", f"{s}/1",
             f"x = {s}", f"n={s}", f"\\{{{s}\\}}", f"{s}\\%", f"{s}^\\circ", f"{s}^{{\\circ}}",
             f"{s} \\text{{ cm}}", f"{s}\\text{{cm}}", f"\\text{{{s} cm}}", f"\\${s}", f"{s} \\text{{ dollars}}",
             f"\\text{{{s}}}.", f"{s}\\,", f"\\;{s}", f"{s} \\quad", f"\\displaystyle {s}", s.translate(FULL_WIDTH),
             f"{s}{{}}", f"{s}^{{1}}", f"{s}\\cdot 1", f"{s}!" if n < 100 else f"{s}?", f"{n + 1}",
             f"{max(n - 1, 0)}", f"-{s}", f"{n * 10}",
             f"{s}0", f"{s[:-1] or '0'}", f"\\text{{0{s}}}", f"{s}\\!", f"\\boxed{{{s}}}"]
    if len(s) >= 2:
        i = rng.randrange(1, len(s))
        forms += [s[:i] + " " + s[i:], s[:i] + "\\," + s[i:], s[:i] + "  " + s[i:]]
    if n >= 1000:
        forms += [_thousands(n, ","), _thousands(n, "{,}"), _thousands(n, "\\,"), _thousands(n, " "),
                  _thousands(n, "\\;"), _thousands(n, "\\!"), _thousands(n, "."), _thousands(n, ",") + "."]
    return forms


def fraction_forms(p: int, q: int) -> list[str]:
    forms = [f"\\frac{{{p}}}{{{q}}}", f"\\dfrac{{{p}}}{{{q}}}", f"\\tfrac{{{p}}}{{{q}}}", f"{p}/{q}",
             f"{p} / {q}", f"-\\frac{{{p}}}{{{q}}}", f"\\frac{{-{p}}}{{{q}}}", f"\\frac{{{2 * p}}}{{{2 * q}}}",
             f"\\frac {{{p}}} {{{q}}}", f"\\left(\\frac{{{p}}}{{{q}}}\\right)", f"\\frac{{{p}}}{{{q}}}.",
             f"\\text{{{p}/{q}}}", f"{p}/{q}".translate(FULL_WIDTH), f"\\frac{{{p}}}{{{q}}}\\%",
             f"{p / q:.6f}", f"{p / q:.3f}", f"{p / q:.8f}", f"{p / q:.2f}".rstrip("0"), f"{p}\\div{q}",
             f"\\frac{{{p + 1}}}{{{q}}}", f"\\frac{{{q}}}{{{p}}}", f"{p}:{q}", f"\\frac{{{p}}}{{{q}}}\\text{{ cm}}"]
    if p < 10 and q < 10:
        forms += [f"\\frac{p}{q}", f"\\frac {p} {q}", f"\\dfrac{p}{q}"]
    if p > q:
        forms += [f"{p // q}\\frac{{{p % q}}}{{{q}}}", f"{p // q} \\frac{{{p % q}}}{{{q}}}"]
    return forms


def decimal_forms(x: str) -> list[str]:
    whole, _, frac = x.partition(".")
    forms = [x, x + "0", x + ".", "0" + x, f"\\text{{{x}}}", x.lstrip("0") or x, x.translate(FULL_WIDTH),
             x + "\\%", f"{x}\\text{{ m}}", x.replace(".", ","), x.replace(".", "{.}"), f"${x}$"]
    if frac:
        forms += [f"{whole}.{frac[:-1]}" if len(frac) > 1 else whole, f"{whole}.{frac}1"]
    return forms


def radical_forms(a: int, b: int) -> list[str]:
    return [f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"{a} \\sqrt {b}" if b < 10 else f"{a} \\sqrt{{{b}}}",
            f"{a}\\cdot\\sqrt{{{b}}}", f"\\sqrt{{{b}}}\\cdot {a}", f"{a}\\sqrt{{{b}}}.", f"\\text{{{a}}}\\sqrt{{{b}}}",
            f"{a}\\left(\\sqrt{{{b}}}\\right)", f"{a * (b ** 0.5):.4f}", f"{a * (b ** 0.5):.7f}",
            f"{a + 1}\\sqrt{{{b}}}", f"\\frac{{{a}\\sqrt{{{b}}}}}{{1}}", f"{a}\\sqrt{{{b}}}\\,", f"{a}\\sqrt{{{b + 1}}}",
            f"{a}\\sqrt{{{b}}}".translate(FULL_WIDTH), f"{a}\\sqrt{{{b}}} \\text{{ units}}", f"\\sqrt{{{b}}}^{{{a}}}"]


def interval_forms(a: int, b: int) -> list[str]:
    return [f"({a}, {b})", f"({a},{b})", f"\\left({a}, {b}\\right)", f"[{a}, {b}]", f"[{a}, {b})", f"({a}, {b}]",
            f"({b}, {a})", f"(-\\infty, {a})", f"(-\\infty,{a}]", f"[{b}, \\infty)", f"({a}, \\infty)",
            f"(-\\infty, {a}) \\cup ({b}, \\infty)", f"(-\\infty,{a})\\cup({b},\\infty)", f"{a} < x < {b}",
            f"x \\in ({a}, {b})", f"\\left[{a},{b}\\right]", f"({a}, {b}).", f"\\text{{({a}, {b})}}",
            f"({a}, {b})".translate(FULL_WIDTH), f"({a},\\,{b})", f"\\left( {a}, {b} \\right]"]


def set_forms(items: list[int]) -> list[str]:
    inner = ", ".join(map(str, items))
    rev = ", ".join(map(str, reversed(items)))
    return [f"\\{{{inner}\\}}", f"\\{{{rev}\\}}", inner, rev, f"\\left\\{{{inner}\\right\\}}", f"({inner})",
            f"[{inner}]", f"{inner}.", " \\text{ and } ".join(map(str, items)), ",".join(map(str, items)),
            f"\\{{{inner}, {items[-1] + 1}\\}}", f"\\{{{', '.join(map(str, items[:-1])) or '0'}\\}}",
            "; ".join(map(str, items)), f"x = {items[0]}" + "".join(f", x = {i}" for i in items[1:]),
            f"\\{{{inner}\\}}".translate(FULL_WIDTH)]


LETTERS = ["A", "B", "C", "D", "E", "a", "b", "c", "e", "i", "x"]


def letter_forms(c: str) -> list[str]:
    return [c, c.lower(), c.upper(), f"({c})", f"\\text{{{c}}}", f"\\textbf{{{c}}}", f"\\text{{({c})}}",
            f"\\mathrm{{{c}}}", f"{c}.", f"({c}) 5", f"\\text{{{c}}}.", f"{c})", f"\\text{{ {c} }}", f"{c}{c}",
            f"\\mathbf{{{c}}}", f"{c}, {c}"]


# LaTeX that is broken, or no answer at all.
MALFORMED = ["\\frac{1}{", "\\frac{1}", "\\frac12}", "\\sqrt{", "\\sqrt", "{1", "1}}", "\\left(1,2", "(1,2\\right)",
             "^", "_", "\\\\", "\\textbf{", "&", "\\begin{pmatrix}1", "1+", "x=", "=5", "\\", "\\text{", "}{",
             "\\frac{}{}", "\\sqrt{}", "..", ".", ",", "\\,", "$", "$$", "\\(", "\\)", "1..5", "--3", "3--",
             "\\cdot", "\\infty\\infty", "\\{", "\\}", "\\left.", "\\right.", "()", "[]", "\\emptyset",
             "\\varnothing", "\\text{no solution}", "\\text{None}", "undefined", "\\mathrm{DNE}", "0/0", "1/0",
             "\\frac{1}{0}", "\\frac{0}{0}", "\\infty", "-\\infty", "\\pm 2", "2 \\pm \\sqrt{3}", "?"]


def response_forms(answer: str, rng: random.Random) -> list[str]:
    """The ways a response can carry an answer: boxed once, boxed twice, nested, empty, missing."""
    other = rng.choice(["0", "1", "7", "x", "\\frac{1}{2}", ""])
    return [f"\\boxed{{{answer}}}", f"So the answer is $\\boxed{{{answer}}}$.",
            f"First \\boxed{{{other}}}, then \\boxed{{{answer}}}", f"\\boxed{{{answer}}} or maybe \\boxed{{{other}}}",
            f"\\boxed{{\\boxed{{{answer}}}}}", f"\\boxed{{{answer}}} \\boxed{{}}", f"\\fbox{{{answer}}}",
            f"\\boxed {answer}", f"The answer is {answer}.", f"\\boxed{{ {answer} }}", f"\\[\n\\boxed{{{answer}}}\n\\]",
            f"\\boxed{{{answer}", f"\\boxed{{\\text{{{answer}}}}}"]


def corpus(seed: int = 0) -> list[tuple[str, tuple[str, ...]]]:
    """Every distinct pair, in a fixed order."""
    rng = random.Random(seed)
    pairs: list[tuple[str, list[str]]] = []

    def add(answers: list[str], refs: list[str], wrap: bool = True) -> None:
        for a in answers:
            pairs.append((f"\\boxed{{{a}}}" if wrap else a, refs))

    aime = [int(r["answer"]) for r in _lines("aime25_test.jsonl")]
    ints = aime + [0, 1, 7, 10, 99, 100, 999] + rng.sample(range(2, 1000), 10) + [1000, 1024, 2025, 12345, 1000000]
    for n in ints:
        forms = integer_forms(n, rng)
        for ref in (str(n), str(n).zfill(3), f"\\text{{{n}}}", f"{n}."):
            add(forms if ref == str(n) else rng.sample(forms, 12), [ref])
    for p, q in [(1, 2), (3, 4), (2, 3), (5, 7), (7, 3), (11, 4), (1, 8), (22, 7), (9, 256), (639, 40), (17, 50)]:
        forms = fraction_forms(p, q)
        for ref in (f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}", f"{p / q:.6f}".rstrip("0")):
            add(forms, [ref])
    for x in ["0.5", ".35625", "3.14", "2.5", "0.0000672", "12.727922", "0.333", "100.25", "-1.5", "1000000.5"]:
        forms = decimal_forms(x)
        for ref in (x, x.lstrip("0") or x, f"\\text{{{x}}}"):
            add(forms + decimal_forms(x.rstrip("0")), [ref])
    for a, b in [(9, 2), (2, 3), (3, 5), (10, 7), (1, 21)]:
        forms = radical_forms(a, b)
        for ref in (f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"\\frac{{{2 * a}\\sqrt{{{b}}}}}{{2}}"):
            add(forms, [ref])
    for a, b in [(-3, 2), (0, 1), (1, 5), (-1, 1)]:
        forms = interval_forms(a, b)
        for ref in (f"({a}, {b})", f"[{a}, {b}]", f"(-\\infty, {a}) \\cup ({b}, \\infty)", f"[{a},{b})"):
            add(forms, [ref])
    for items in ([1, 2], [-3, 3], [2, 5, 8], [0]):
        forms = set_forms(items)
        for ref in (f"\\{{{', '.join(map(str, items))}\\}}", ", ".join(map(str, items)), f"({', '.join(map(str, items))})"):
            add(forms, [ref])
    for c in LETTERS:
        forms = letter_forms(c)
        for ref in (c, c.lower(), f"\\text{{({c})}}", f"({c})", "3"):
            add(forms, [ref])
    for m in MALFORMED:
        for ref in (m, "1", "0", "\\frac{1}{2}", "x"):
            add([m], [ref])
        add(["1", "x", "0"], [m])

    # MATH-500's references: each against itself in other writings, and against others.
    math500 = [r["answer"] for r in _lines("math500_answers.jsonl")]
    for ref in math500:
        variants = {ref, ref.replace("\\left", "").replace("\\right", ""), ref.replace("\\dfrac", "\\frac"),
                    ref.replace(" ", ""), f"\\text{{{ref}}}", ref + ".", f"${ref}$", ref.replace(",", ", "),
                    ref.replace("\\frac", "\\dfrac"), ref.translate(FULL_WIDTH), f"\\mathbf{{{ref}}}", ref + "\\,",
                    f"\\left({ref}\\right)", ref.replace("\\!", ""), ref.replace("\\text", "\\textbf"),
                    ref.replace("^\\circ", ""), ref.replace("\\%", ""), ref.replace("\\pi", "\\cdot\\pi"),
                    ref.replace("{", "{ ").replace("}", " }"), f"x = {ref}", ref[:-1], ref + "}",
                    rng.choice(math500), rng.choice(math500)}
        variants.discard(ref)
        add([ref, *rng.sample(sorted(variants), min(9, len(variants)))], [ref])
        if ref.strip().isdigit():
            add(rng.sample(integer_forms(int(ref), rng), 12), [ref])

    # Responses: one answer carried the many ways a response carries it.
    carried = [str(n) for n in aime[:10]] + ["\\frac{1}{2}", "0.5", "9\\sqrt{2}", "(1, 2)", "\\{1,2\\}", "B",
                                             "1,000", "x = 5", "\\text{Evelyn}", "50\\%", "104."]
    for a in carried:
        for ref in (a, "1", "\\frac{1}{2}", "B", "0.5"):
            add(response_forms(a, rng), [ref], wrap=False)

    # AReaL's boba rows: their references against the real responses and their boxed answers.
    for case in _lines("boba_reward_cases.jsonl"):
        refs = case["solutions"]
        add(case["generateds"], refs, wrap=False)
        add(case["generateds"], [s.replace("\\boxed{", "").rstrip("}") for s in refs], wrap=False)

    # Several references: right when any one matches.
    for n in rng.sample(ints, 20):
        add(rng.sample(integer_forms(n, rng), 8), [str(n + 1), str(n)])
        add(rng.sample(integer_forms(n, rng), 4), [str(n + 1), f"\\text{{{n}}}"])
    return list(dict.fromkeys((response, tuple(refs)) for response, refs in pairs))


def sample(k: int, seed: int = 1) -> list[tuple[str, tuple[str, ...]]]:
    """`k` pairs of the corpus drawn at random (the same ones every time)."""
    return random.Random(seed).sample(corpus(), k)


# Run in fresh interpreters that import math-verify and nothing of this project.
REFERENCE = r"""
import json, logging, sys
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class Timeouts(logging.Handler):  # math-verify reports its own time limits (5 s) only as a warning
    count = 0

    def emit(self, record):
        Timeouts.count += "Timeout" in record.getMessage()


log = logging.getLogger("math_verify")
log.addHandler(Timeouts())
log.setLevel(logging.WARNING)
log.propagate = False


def boxed(s):
    return s if "\\boxed" in s else "\\boxed{" + s + "}"


parsed = {}  # parse's result depends on its input alone: each string is parsed once


def parse_once(s):
    if s not in parsed:
        parsed[s] = parse(boxed(s), extraction_config=CONFIG)
    return parsed[s]


def correct(answer, refs):
    if answer is None:
        return False
    pred = parse_once(answer)
    return any(verify(parse_once(ref), pred) for ref in refs)


with open(sys.argv[1], encoding="utf-8") as f:
    tasks = json.load(f)
verdicts = [correct(answer, refs) for answer, refs in tasks]
assert not any(m == "rlrecipe" or m.startswith("rlrecipe.") for m in sys.modules), "not a clean interpreter"
print(json.dumps({"verdicts": verdicts, "timeouts": Timeouts.count}))
"""


def reference_verdicts(tasks: list[tuple[str | None, list[str]]], procs: int = 2) -> tuple[list[bool], int]:
    """math-verify's verdict on each (extracted answer or None, references), computed in `procs`
    clean interpreters (no PYTHONPATH, started outside the repository), and how many of its
    parses and comparisons ran into its time limit (each is a wrong verdict)."""
    chunks = [tasks[i::procs] for i in range(procs)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONHASHSEED"] = GRADER_HASH_SEED  # math-verify's verdict can depend on it (rlrecipe/reward/grader.py)
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        for i, chunk in enumerate(chunks):
            path = Path(tmp) / f"tasks{i}.json"
            path.write_text(json.dumps(chunk), encoding="utf-8")
            running.append(subprocess.Popen([sys.executable, "-c", REFERENCE, str(path)], cwd=tmp, env=env,
                                            stdout=subprocess.PIPE, text=True))
        outs = []
        for p in running:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"the math-verify reference exited with {p.returncode}")
            outs.append(json.loads(out))
    verdicts: list[bool] = [False] * len(tasks)
    for i, out in enumerate(outs):
        verdicts[i::procs] = out["verdicts"]
    return verdicts, sum(out["timeouts"] for out in outs)
