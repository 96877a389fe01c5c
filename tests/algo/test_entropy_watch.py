"""Entropy alarms: flags per step and one warning as each alarm starts."""

from rlrecipe.algo.entropy_watch import EntropyWatch
from rlrecipe.recipe.training import EntropyWatch as EntropyWatchSection


def _run(watch, entropies):
    return [watch.update(e, step=i + 1) for i, e in enumerate(entropies)]


def test_collapse_needs_patience_steps_in_a_row_and_warns_once():
    warnings = []
    watch = EntropyWatch(low=0.5, high=None, patience=3, warn=warnings.append)
    flags = _run(watch, [0.6, 0.4, 0.3, 0.7, 0.4, 0.3, 0.2, 0.1, 0.9])
    # under 0.5 at steps 2-3 (interrupted), then 5-8: the alarm is on at steps 7 and 8 only
    assert [f["entropy_collapse_alarm"] for f in flags] == [0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert all(f["entropy_explosion_alarm"] == 0 for f in flags)
    assert warnings == ["step 7: entropy collapse: mean token entropy 0.2 below 0.5 for 3 steps"]


def test_explosion_and_a_second_alarm_warns_again():
    warnings = []
    watch = EntropyWatch(low=0.1, high=2.0, patience=2, warn=warnings.append)
    flags = _run(watch, [2.5, 2.6, 2.7, 1.0, 2.1, 2.2, 0.05])
    assert [f["entropy_explosion_alarm"] for f in flags] == [0, 1, 1, 0, 0, 1, 0]
    assert [f["entropy_collapse_alarm"] for f in flags] == [0] * 7
    assert [w.split(":")[0] for w in warnings] == ["step 2", "step 6"]
    assert all("explosion" in w and "above 2.0" in w for w in warnings)


def test_boundary_values_do_not_count_and_no_bounds_means_no_flags():
    watch = EntropyWatch(low=0.5, high=1.5, patience=1, warn=lambda m: None)
    assert _run(watch, [0.5, 1.5]) == [{"entropy_collapse_alarm": 0.0, "entropy_explosion_alarm": 0.0}] * 2
    off = EntropyWatch.from_config(EntropyWatchSection())
    assert not off.enabled and off.update(0.0) == {}


def test_the_default_warning_is_one_console_line_and_quiet_prints_none():
    from rlrecipe.core.console import console

    watch = EntropyWatch.from_config(EntropyWatchSection(low=1.0, patience=2))
    with console.capture() as captured:
        _run(watch, [0.5, 0.4, 0.3])
    assert captured.get().strip() == "warning: step 2: entropy collapse: mean token entropy 0.4 below 1.0 for 2 steps"
    quiet = EntropyWatch.from_config(EntropyWatchSection(low=1.0, patience=2), quiet=True)
    with console.capture() as captured:
        flags = _run(quiet, [0.5, 0.4])
    assert captured.get() == "" and flags[-1]["entropy_collapse_alarm"] == 1.0


def test_resume_restores_a_streak_without_warning_again():
    warnings = []
    watch = EntropyWatch(low=0.5, high=2.0, patience=3, warn=warnings.append)
    watch.resume([0.4, 0.6, 0.4, 0.3])  # the logged steps 1-4: under 0.5 at steps 3 and 4
    assert (watch.steps_below, watch.steps_above, warnings) == (2, 0, [])
    assert watch.update(0.2, step=5)["entropy_collapse_alarm"] == 1.0  # the third in a row
    assert warnings == ["step 5: entropy collapse: mean token entropy 0.2 below 0.5 for 3 steps"]
    watch.resume([2.5, 2.1, 2.2])
    assert (watch.steps_below, watch.steps_above) == (0, 3)
    watch.resume([])
    assert (watch.steps_below, watch.steps_above) == (0, 0)


def test_the_bad_step_guard_resumes_its_count():
    import pytest

    from rlrecipe.core.errors import UserError
    from rlrecipe.train.bad_steps import BadStepGuard, rl_step_skipped

    bad, good = {"skipped_minibatches": 2.0, "minibatches": 2.0}, {"skipped_minibatches": 1.0, "minibatches": 2.0}
    guard = BadStepGuard(3, "rl", rl_step_skipped)
    guard.resume([bad, good, bad, bad])
    assert guard.in_a_row == 2
    with pytest.raises(UserError, match="step 5: .* 3 steps in a row"):
        guard.check(bad, 5)
