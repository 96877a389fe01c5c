r"""The reward is math-verify's verdict: the grader (fast path, worker patches and `values_apart` on)
against math-verify alone, in clean interpreters, on a corpus of real answer forms
(tests/grading_corpus.py). The whole corpus is slow; a sample of it runs with the fast tests."""

from __future__ import annotations

import pytest

from rlrecipe.reward import Grader, extract_boxed, fast_grade
from tests.grading_corpus import corpus, reference_verdicts, sample


def disagreements(pairs) -> tuple[list, dict]:
    """Pairs on which the grader and math-verify disagree, and what settled the grader's verdicts."""
    tasks = [(extract_boxed(response), list(refs)) for response, refs in pairs]
    expected, reference_timeouts = reference_verdicts(tasks)
    with Grader(timeout=20.0, workers=2) as g:
        results = g.grade([response for response, _ in pairs], [list(refs) for _, refs in pairs])
        stats = dict(g.stats)
    assert reference_timeouts == 0 and stats["timeouts"] == 0  # every verdict compared is a real one
    wrong = [(pair, r.extracted, r.correct) for pair, r, want in zip(pairs, results, expected, strict=True)
             if r.correct != want]
    stats["correct"] = sum(expected)
    return wrong, stats


def test_the_corpus_holds_every_form_it_claims():
    pairs = corpus()
    assert len(pairs) >= 10_000 and len(set(pairs)) == len(pairs)
    responses = [response for response, _ in pairs]
    refs = [ref for _, rs in pairs for ref in rs]
    assert all(ref.strip() for ref in refs)
    for form in ["\\boxed{070}", "\\boxed{70.}", "\\boxed{\\text{70}}", "\\boxed{1,000}", "\\boxed{1\\,000}",
                 "\\boxed{１０２４}", "\\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{0.5}",
                 "\\boxed{9\\sqrt{2}}", "\\boxed{(-3, 2]}", "\\boxed{\\{1, 2\\}}", "\\boxed{70 \\text{ cm}}",
                 "\\boxed{\\frac{1}{}", "\\boxed{B}", "\\boxed{\\left(1, 5\\right)}", "\\boxed{70}$.", "\\boxed{}"]:
        assert any(form in r for r in responses), form
    assert sum(extract_boxed(r) is None for r in responses) > 100  # no box, an empty or unbalanced last one
    assert sum(r.count("\\boxed") > 1 for r in responses) > 500
    # real answers: MATH-500's references and AReaL's responses are among them
    assert "\\left( 3, \\frac{\\pi}{2} \\right)" in refs and "\\boxed{9\\sqrt{2}}" in refs


def settled_by_values_apart(pairs) -> int:
    """How many of the pairs that reach a worker its `values_apart` settles without `verify`."""
    from rlrecipe.reward.worker import _parse, _parse_gold, values_apart

    settled = 0
    for response, refs in pairs:
        x = extract_boxed(response)
        if x is None or fast_grade(x, list(refs)) is not None:
            continue
        pred = _parse(x)
        settled += bool(pred) and any(values_apart(_parse_gold(a), pred) for a in refs if _parse_gold(a))
    return settled


def test_the_grader_gives_math_verifys_verdict_on_a_sample():
    pairs = sample(300)
    wrong, stats = disagreements(pairs)
    assert not wrong
    # every path was compared: the fast path, the workers' `verify` and their `values_apart`
    assert stats["fast_path"] >= 40 and stats["math_verify"] >= 150 and settled_by_values_apart(pairs) >= 5
    assert 75 <= stats["correct"] <= 225  # correct and wrong answers both


@pytest.mark.slow
def test_the_grader_gives_math_verifys_verdict_on_the_whole_corpus():
    pairs = corpus()
    wrong, stats = disagreements(pairs)
    assert not wrong, wrong[:20]
    assert stats["fast_path"] >= 2500 and stats["math_verify"] >= 5000
    assert stats["correct"] >= 0.3 * len(pairs) and stats["correct"] <= 0.7 * len(pairs)


def test_what_a_looser_grader_would_count_right_math_verify_counts_wrong():
    """The forms a clean-up would equate (trailing '.', \\text{}, digits split by spaces or \\,,
    full-width digits) are wrong to math-verify, and so to the grader, which leaves them to it."""
    pairs = [("\\boxed{104.}", ("104",)), ("\\boxed{\\text{023}}", ("023",)), ("\\boxed{1\\,000}", ("1000",)),
             ("\\boxed{１/２}", ("\\frac{1}{2}",)), ("\\boxed{7 0}", ("70",)), ("\\boxed{70}", ("70.",))]
    expected, timeouts = reference_verdicts([(extract_boxed(r), list(a)) for r, a in pairs], procs=1)
    assert expected == [False] * len(pairs) and timeouts == 0
    assert all(fast_grade(extract_boxed(r), list(a)) is None for r, a in pairs)
    wrong, _ = disagreements(pairs)
    assert not wrong

