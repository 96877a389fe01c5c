r"""Reward: last-\boxed extraction, fast path, math-verify in worker processes with hard time limits."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rlrecipe.reward import (
    Grader,
    GradeResult,
    extract_boxed,
    fast_grade,
    math_verify_correct,
    reward_of,
)


@pytest.fixture(scope="module")
def grader():
    with Grader(timeout=2.0, workers=2) as g:
        yield g


# -- extraction -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{70}.", "70"),
    (r"\boxed{3} then \boxed{5}", "5"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{ 12 }", "12"),
    (r"\boxed {12}", "12"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
    (r"\boxed{a\\}", "a\\\\"),  # \\ is an escaped backslash, the brace closes the box
    (r"\boxed 7", "7"),
    (r"the answer is $\boxed 70$.", "70"),
    (r"\boxed7.", "7"),
    (r"\fbox{12}", "12"),
    (r"\boxed{1} and \fbox{2}", "2"),
    (r"\fbox{2} and \boxed{1}", "1"),
    (r"\boxed{\boxed{5}}", "5"),
    (r"\boxed{4} \fboxsep", "4"),  # \fboxsep is another command
    (r"\boxed{4} \boxedx", "4"),
    ("no box here", None),
    ("", None),
    (r"\boxed{}", None),
    (r"\boxed{\frac{1}{2}", None),  # the last box is unbalanced (truncated)
    (r"\boxed{1} then \boxed{\frac{1}{2}", None),
    (r"ends with \boxed", None),
    (r"\fbox 3", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_huge_inputs_return():
    mb = 1 << 20
    assert extract_boxed("x" * mb) is None
    assert extract_boxed("x" * mb + r"\boxed{42}") == "42"
    assert extract_boxed(r"\boxed{" + "{" * mb) is None
    assert extract_boxed(r"\boxedx" * (mb // 7) + r"\fbox{1}") == "1"  # many false candidates
    deep = r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
    assert extract_boxed(deep) == "{" * 10_000 + "1" + "}" * 10_000
    assert extract_boxed(r"\boxed{" + "\\" * mb) is None


# -- fast path ------------------------------------------------------------------------------

@pytest.mark.parametrize("extracted, answers, expected", [
    ("070", ["70"], True),
    ("-0", ["0"], True),
    ("+5", ["5"], True),
    ("71", ["70"], False),
    ("-3", ["3"], False),
    ("4", ["2", "4"], True),
    ("4", [r"\boxed{04}"], True),  # a boxed reference is parsed as it stands, i.e. as 04 boxed
    ("4", [r"\boxed{4} \boxed{5}"], None),
    (r"\dfrac{1}{2}", [r"\frac{1}{2}"], True),
    ("7" * 400, ["0" + "7" * 399], False),
    ("7" * 400, ["7" * 400], True),
    ("7" * 5000, ["7" * 5000], None),  # beyond int()'s digit limit math-verify cannot parse it
    ("4", ["2", r"\sqrt{16}"], None),  # a reference that is no plain number: math-verify decides
    # nothing is cleaned up: each of these changes math-verify's parse
    (" 70 ", ["070"], None),
    ("70.", ["70"], None),
    (r"\text{70}", ["70"], None),
    ("7\\,0", ["70"], None),
    ("7 0", ["70"], None),
    (r"\left(1,2\right)", ["(1, 2)"], None),
    ("７０", ["70"], None),
    ("$70$", ["70"], None),
    ("70", ["70."], None),
])
def test_fast_grade(extracted, answers, expected):
    assert fast_grade(extracted, answers) is expected


# Plain numbers compared as exact rationals. Wrong only when math-verify would say so too: it
# rounds to 6 decimal places when a decimal is involved (0.3333333 counts as 1/3).
NUMBER_CASES = [
    ("0.5", [r"\frac12"], True),
    ("4", ["2", r"\frac{8}{2}"], True),  # 8/2 = 4
    (r"\frac{1}{2}", ["0.5"], True),
    ("1/2", [r"\frac{2}{4}"], True),
    (r"-\frac{3}{4}", ["-0.75"], True),
    (r"\dfrac{3}{4}", ["3/4"], True),
    (".5", ["0.50"], True),
    ("+0.5", [r"\frac{1}{2}"], True),
    ("-.25", ["-1/4"], True),
    ("3.0", ["3"], True),
    ("2.50", [r"\frac{5}{2}"], True),
    (r"\frac{10}{2}", ["5"], True),
    (r"\frac{0}{7}", ["0"], True),
    (r"\frac{1}{3}", ["0.5"], False),
    (r"\frac{2}{3}", [r"\frac{3}{4}"], False),
    ("3.5", ["3"], False),
    ("-0.5", ["0.5"], False),
    ("0.3", [r"\frac{1}{3}"], False),  # 1/30 apart
    ("0.333", [r"\frac13"], False),  # 1/3000 apart: rounding to 6 places keeps them apart
    (r"\frac{7}{3}", ["2.33"], False),
    ("999999.5", ["999999"], False),
    ("0.00002", ["0"], False),
    (r"\frac{1}{100000000000000000000}", [r"\frac{1}{100000000000000000001}"], False),  # exact rationals
    ("12345678901234567890", ["12345678901234567891"], False),
    ("0.125", ["1/8"], True),
]

NOT_FAST = [  # math-verify decides these
    ("0.3333333", [r"\frac{1}{3}"]),  # within its rounding: it says correct
    ("0.00001", ["0"]),  # 1e-5 apart: too close to call here
    ("12.000001", ["12"]),
    ("1000000.5", ["1000000"]),  # beyond the range where its 15-digit floats are exact enough
    ("0.1234567", [r"\frac{1234567}{10000000}"]),  # equal, but more than 6 places: its rounding decides
    (r"\frac 3 4", ["0.75"]),  # spaces
    (r"\frac{1}{0}", ["1"]),
    ("1,000", ["1000"]),  # a thousands separator, or a pair
    (r"2\frac{1}{2}", ["2.5"]),  # a mixed number
    ("1e3", ["1000"]),
    (r"50\%", ["50"]),
    ("x=5", ["5"]),
    (r"\frac{-1}{2}", ["-0.5"]),
    ("0.7", ["0.5", r"\sqrt{2}"]),  # unequal to 0.5, and \sqrt{2} is math-verify's
]


@pytest.mark.parametrize("extracted, answers, expected", NUMBER_CASES)
def test_fast_grade_numbers(extracted, answers, expected):
    assert fast_grade(extracted, answers) is expected


@pytest.mark.parametrize("extracted, answers", NOT_FAST)
def test_fast_grade_leaves_to_math_verify(extracted, answers):
    assert fast_grade(extracted, answers) is None


def test_fast_path_numbers_agree_with_math_verify():
    # the fast path must not change a verdict, only skip the worker
    for extracted, answers, expected in NUMBER_CASES:
        assert math_verify_correct(extracted, answers, shortcut=False) is expected, (extracted, answers)
    # and why a near miss is left alone: math-verify's rounding calls it correct
    assert math_verify_correct("0.3333333", [r"\frac{1}{3}"]) is True
    assert fast_grade("0.5", ["0.5", r"\sqrt{2}"]) is True  # one equal reference is enough


LETTER_CASES = [
    ("B", ["B"], True),
    ("b", ["B"], True),  # math-verify: the same symbol in either case
    ("B", ["C"], False),
    ("B", ["192"], False),  # a letter where a number was asked (AReaL's reward cases have 13)
    ("7", ["D"], False),
    ("0.5", ["x"], False),
    ("A", ["B", "3"], False),
    ("A", ["B", "a"], True),
]
LETTERS_NOT_FAST = [("e", ["2.718281828"]), ("E", ["e"]), ("i", ["I"]), ("B", [r"\sqrt{2}"]), ("AB", ["A"]),
                    ("B", ["(B)"]), (r"\text{C}", ["c"])]


@pytest.mark.parametrize("extracted, answers, expected", LETTER_CASES)
def test_fast_grade_letters(extracted, answers, expected):
    assert fast_grade(extracted, answers) is expected
    assert math_verify_correct(extracted, answers, shortcut=False) is expected  # the verdict math-verify gives


@pytest.mark.parametrize("extracted, answers", LETTERS_NOT_FAST)
def test_fast_grade_leaves_e_i_and_the_rest_to_math_verify(extracted, answers):
    assert fast_grade(extracted, answers) is None


def test_every_letter_verdict_of_the_fast_path_is_math_verifys():
    """All 52 letters against each other and against numbers: wherever the fast path decides, it
    decides as math-verify does (math-verify: e == 2.718281828, and b == B but i != I)."""
    import string

    numbers = ["0", "1", "2", "192", "-1", "0.5", r"\frac{1}{2}", "2.718281828", "3.14159265"]
    others = list(string.ascii_letters) + numbers
    decided = 0
    for a in string.ascii_letters:
        for b in others:
            for x, ref in ((a, b), (b, a)):
                fast = fast_grade(x, [ref])
                if fast is not None:
                    decided += 1
                    assert fast is math_verify_correct(x, [ref], shortcut=False), (x, ref)
    assert decided > 2 * 48 * 48  # every pair but those with e or i


# Answers of every shape math-verify parses: integers, decimals near and far, fractions, roots,
# constants, degrees, percentages, complex numbers, infinities, sets, tuples, intervals,
# equations, variables, units, matrices, and values equal to each other in other forms.
APART_STRINGS = (r"18|9\sqrt{2}|12.7279|12.727922|0.5|\frac{1}{2}|50\%|0.5\%|50|\pi|3.14159|3.141593|"
                 r"\frac{22}{7}|e|2.718281828|i|1+i|-1|\infty|-\infty|\frac{\sqrt{3}}{2}|0.866025|"
                 r"\sin 60^\circ|60^\circ|\frac{\pi}{3}|60|\log_2 8|3|0|-0|0.0|10^{100}|10^{100}+1|"
                 r"1000|1,000|2^{10}|1024|10!|3628800|x=5|5|\{1,2\}|(1,2)|[1,2]|\frac{1}{3}|0.333333|"
                 r"0.3333|\sqrt{8}|2\sqrt{2}|x|2x|0.00001|0.000011|1.00001|1.000011|100000.5|100001|"
                 r"\begin{pmatrix}1\\2\end{pmatrix}|1\frac{3}{4}|1.75|\frac{7}{4}\text{ cm}|\sqrt[3]{27}|"
                 r"\cos\pi|\frac{1}{\sqrt{2}}|0.707107|5\%|0.05").split("|")


@pytest.mark.slow
def test_values_apart_never_changes_a_verdict():
    """Every ordered pair of the answers above: wherever `values_apart` settles a pair without
    `verify`, `verify` itself calls it wrong (2,690 of the 4,489 pairs are settled so)."""
    from rlrecipe.reward.worker import _mv, _parse, values_apart

    _, verify, _ = _mv()
    parsed = {s: _parse(s) for s in APART_STRINGS}
    fired = 0
    for gold in APART_STRINGS:
        for pred in APART_STRINGS:
            if parsed[gold] and parsed[pred] and values_apart(parsed[gold], parsed[pred]):
                fired += 1
                assert not verify(parsed[gold], parsed[pred], timeout_seconds=None), (gold, pred)
    assert fired > 2500


@pytest.mark.parametrize("extracted, answer, apart", [
    ("18", r"9\sqrt{2}", True),  # AReaL's reward cases: 13 such wrong answers went to verify
    (r"18(\sqrt{2} - 1)", r"9\sqrt{2}", True),
    ("12.727922", r"9\sqrt{2}", False),  # equal after math-verify's rounding to 6 places
    ("12.72792", r"9\sqrt{2}", False),  # closer than the margin: verify decides
    ("50", r"50\%", False),  # a percentage is left to verify (it calls 50% == 50)
    ("x", "5", False),  # a variable
    (r"\{1,2\}", "1", False),  # a set
    ("1+i", "1", False),  # complex
    (r"\infty", "1", False),
    (r"10^{100}+1", r"10^{100}", False),  # relatively too close
])
def test_values_apart_cases(extracted, answer, apart):
    from rlrecipe.reward.worker import _parse, values_apart

    assert values_apart(_parse(answer), _parse(extracted)) is apart
    assert math_verify_correct(extracted, [answer]) is math_verify_correct(extracted, [answer], shortcut=False)


def test_fast_path_needs_no_pool():
    with Grader(timeout=2.0) as g:
        res = g.grade([r"\boxed{070}", r"\boxed{5}", "no answer", r"\boxed{9}"],
                      [["70"], ["6"], ["1"], ["9"]], truncated=[False, False, False, True])
        assert [r.correct for r in res] == [True, False, False, False]
        res = g.grade([r"\boxed{\frac{1}{2}}", r"\boxed{0.75}", r"\boxed{2.5}"], [["0.5"], ["3/4"], ["2"]])
        assert [r.correct for r in res] == [True, True, False]
        assert g.stats["workers_started"] == 0 and g.stats["math_verify"] == 0


def test_grade_returns_only_once_every_worker_it_started_is_ready():
    """One answer off the fast path starts one worker; then two start a second, but the first,
    ready already, answers both in milliseconds. The call still waits for the second, so its
    start-up is paid inside grade() and not in whatever runs next (an RL step's training, where
    it cost a step about a core-second)."""
    with Grader(timeout=10.0, workers=2) as g:
        assert g.grade([r"\boxed{x^2+2x+1}"], [["(x+1)^2"]])[0].correct
        res = g.grade([r"\boxed{2x+2}", r"\boxed{x^2-1}"], [["2(x+1)"], ["(x-1)(x+1)"]])
        assert [r.correct for r in res] == [True, True]
        assert g.stats["workers_started"] == 2 and g.stats["math_verify"] == 3
        assert len(g._workers) == 2 and all(w.ready for w in g._workers)


# -- the table of tricky cases (expected values written by hand) ---------------------------

CASES = [
    # response, reference answers, correct
    (r"The answer is \boxed{70}", ["070"], True),
    (r"\boxed{070}", ["70"], True),
    (r"\boxed{ 70 }", ["70"], True),
    (r"\boxed{007}", ["7"], True),
    (r"\boxed{71}", ["70"], False),
    (r"\boxed{-3}", ["-3"], True),
    (r"\boxed{-3}", ["3"], False),
    (r"\boxed{\frac{1}{2}}", ["0.5"], True),
    (r"\boxed{0.5}", [r"\frac12"], True),
    (r"\boxed{1/2}", [r"\frac{1}{2}"], True),
    (r"\boxed{\dfrac{3}{4}}", ["3/4"], True),
    (r"\boxed{\frac{1}{3}}", ["0.5"], False),
    (r"\boxed{0.333}", [r"\frac{1}{3}"], False),
    (r"\boxed{3.0}", ["3"], True),
    (r"\boxed{3.5}", ["3"], False),
    (r"\boxed{\text{70}}", ["70"], True),
    (r"\boxed{\textbf{70}}", ["70"], True),
    (r"\boxed{\text{(B)}}", ["B"], True),
    (r"\boxed{(1,2)}", ["(1, 2)"], True),
    (r"\boxed{\left(1,2\right)}", ["(1,2)"], True),
    (r"\boxed{[1,3)}", ["[1,3)"], True),
    (r"\boxed{(1,3]}", ["[1,3)"], False),
    (r"\boxed{(-\infty, 2]}", [r"(-\infty,2]"], True),
    (r"\boxed{\{1,2\}}", [r"\{2,1\}"], True),
    (r"\boxed{x=5}", ["5"], True),
    (r"\boxed{2\sqrt{2}}", [r"\sqrt{8}"], True),
    (r"\boxed{\sqrt{2}/2}", [r"\frac{\sqrt{2}}{2}"], True),
    (r"\boxed{\sqrt{2}}", ["1.41421356"], True),
    (r"\boxed{\frac{\pi}{2}}", [r"\pi/2"], True),
    (r"\boxed{x^2+2x+1}", ["(x+1)^2"], True),
    (r"\boxed{x^2+1}", ["(x+1)^2"], False),
    (r"\boxed{1,000}", ["1000"], True),
    (r"\boxed{90^\circ}", ["90"], True),
    (r"\boxed{a}", ["b"], False),
    (r"\boxed{\frac{1}{0}}", ["1"], False),
    (r"\boxed{4}", ["2", "4"], True),
    (r"\boxed{3} at first, but finally \boxed{5}", ["5"], True),
    (r"\boxed{5} at first, but finally \boxed{3}", ["5"], False),
    (r"\boxed 7", ["7"], True),
    (r"\fbox{12}", ["12"], True),
    (r"\boxed{\boxed{5}}", ["5"], True),
    (r"the answer is 70", ["70"], False),  # no box, no answer
    (r"\boxed{}", ["1"], False),
    (r"\boxed{\frac{1}{2}", ["1/2"], False),  # unbalanced
    (r"\boxed{5}", [r"\boxed{5}"], True),  # a boxed reference
    (r"\boxed{\frac{10}{2}}", ["5"], True),
]


def test_tricky_cases(grader):
    res = grader.grade([c[0] for c in CASES], [c[1] for c in CASES])
    wrong = [(c[0], c[1], c[2], r) for c, r in zip(CASES, res, strict=True) if r.correct != c[2]]
    assert not wrong
    assert not any(r.timed_out for r in res)


def test_truncated_is_wrong_and_results_line_up(grader):
    res = grader.grade([r"\boxed{\frac{1}{2}}"] * 3 + [r"\boxed{2}"], [["0.5"]] * 3 + [["2"]],
                       truncated=[False, True, False, False])
    assert [r.correct for r in res] == [True, False, True, True]
    assert res[1] == GradeResult(r"\frac{1}{2}", False, False)
    assert grader.grade([], []) == []
    with pytest.raises(ValueError):
        grader.grade(["a"], [])


def test_reward_values():
    assert reward_of(GradeResult("1", True), 5.0, -5.0) == 5.0
    assert reward_of(GradeResult("1", False), 5.0, -5.0) == -5.0
    assert reward_of(GradeResult(None, False, True), 5.0, -5.0) == -5.0  # timed out
    assert reward_of(GradeResult("1", True), correct_value=1.0, wrong_value=0.0) == 1.0
    assert reward_of(GradeResult("1", False), correct_value=1.0, wrong_value=0.0) == 0.0


def test_single_answers_and_mixed_paths(grader):
    # a bare reference answer, an integer one, and a batch mixing the fast path with math-verify
    res = grader.grade([r"\boxed{6}", r"\boxed{0.25}", r"\boxed{7}"], ["06", [r"\frac14"], 7])
    assert [r.correct for r in res] == [True, True, True]


# -- adversarial inputs: every call returns, within the time limit mechanism ---------------

def test_adversarial_inputs_return():
    mb = 1 << 20
    responses = [
        r"\boxed{9^{9^{9^{9^{9}}}}}",
        r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        r"\boxed{" + "1+" * (mb // 2) + "1}",
        "x" * mb,
        r"\boxed{" + "(" * mb + "}",
        r"\boxed{\frac{1}{2}}",
    ]
    answers = [[r"\boxed{1}"], ["1"], ["1"], ["1"], ["1"], ["0.5"]]
    with Grader(timeout=1.0, workers=2) as g:
        res = g.grade(responses, answers)
        assert [r.correct for r in res] == [False] * 5 + [True]
        assert res[0].timed_out  # the tower never evaluates within the limit
        assert res[3].extracted is None
        # the pool is still healthy afterwards
        assert g.grade([r"\boxed{\frac{2}{4}}"], [["0.5"]])[0].correct


def test_hard_kill_replaces_a_hung_worker():
    # With the worker's own SIGALRM disabled only the parent's kill can stop the tower.
    with Grader(timeout=1.0, workers=1, soft_fraction=None) as g:
        g.start()
        first = g._workers[0].proc
        res = g.grade([r"\boxed{9^{9^{9^{9^{9}}}}}"], [["1"]])
        assert res[0] == GradeResult("9^{9^{9^{9^{9}}}}", False, True)
        assert first.poll() is not None  # killed
        assert g.stats["workers_started"] == 2
        assert g.grade([r"\boxed{\frac{3}{6}}"], [["0.5"]])[0].correct


def test_hung_answer_inside_a_batch():
    # Answers queued behind a hung one are not lost with its worker: they go to the replacement.
    tower = r"\boxed{9^{9^{9^{9^{9}}}}}"
    responses = [rf"\boxed{{\frac{{{i}}}{{\sqrt{{4}}}}}}" for i in range(40)]  # math-verify's, not the fast path's
    answers = [[str(i / 2)] for i in range(40)]
    responses[5], answers[5] = tower, ["1"]
    with Grader(timeout=1.0, workers=1, soft_fraction=None) as g:
        g.start()
        res = g.grade(responses, answers)
        assert res[5] == GradeResult("9^{9^{9^{9^{9}}}}", False, True)
        assert all(r.correct and not r.timed_out for i, r in enumerate(res) if i != 5)
        assert g.stats["math_verify"] == 40 and g.stats["workers_started"] == 2 and g.stats["timeouts"] == 1


def test_crashed_worker_is_replaced():
    with Grader(timeout=30.0, workers=1, soft_fraction=None) as g:
        g.start()
        # dies mid-task: graded wrong, not timed out, and the caller carries on
        pid = g._workers[0].proc.pid
        timer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        timer.start()
        res = g.grade([r"\boxed{9^{9^{9^{9^{9}}}}}"], [["1"]])
        timer.join()
        assert res[0] == GradeResult("9^{9^{9^{9^{9}}}}", False, False)
        assert g.stats["crashes"] == 1
        # dies while idle: its next task is retried on a replacement
        g.start()
        g._workers[0].proc.kill()
        g._workers[0].proc.wait()
        assert g.grade([r"\boxed{\frac{3}{6}}"], [["0.5"]])[0].correct


def test_grading_inside_a_thread(grader):
    # math-verify's signal.alarm fails in threads; the worker processes do not care
    out = []
    t = threading.Thread(target=lambda: out.extend(grader.grade([r"\boxed{\frac{1}{4}}"], [["0.25"]])))
    t.start()
    t.join()
    assert out[0].correct


# -- AReaL's own reward cases -------------------------------------------------------------------

def test_every_areal_reward_case_gets_arealss_reward(grader):
    """160 real model responses to the 10 boba rows (16 each), with the ±5 AReaL gave each
    (tests/data/README.md): the references come from the rows' `solutions` through the converter,
    the reward from this grader. Letters for a number, \\sqrt forms, symbolic fractions and
    responses with no box are among them."""
    import json
    from pathlib import Path

    from rlrecipe.data.convert import convert_file

    data = Path(__file__).parents[1] / "data"
    cases = [json.loads(line) for line in (data / "boba_reward_cases.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = convert_file(data / "boba_rl_rows.jsonl", "rl").rows
    responses = [g for c in cases for g in c["generateds"]]
    answers = [r["answers"] for r, c in zip(rows, cases, strict=True) for _ in c["generateds"]]
    expected = [w for c in cases for w in c["rewards"]]
    assert len(responses) == 160 and {-5.0, 5.0} == set(expected)
    got = [reward_of(r, 5.0, -5.0) for r in grader.grade(responses, answers)]
    assert got == expected
    # and a share of them never reach math-verify
    boxed = [(extract_boxed(x), a) for x, a in zip(responses, answers, strict=True)]
    assert sum(e is not None and fast_grade(e, a) is not None for e, a in boxed) >= 100
