"""Each of DAPO's dynamic sampling and overlong handling, QAE and Dr. GRPO through the RL loop, a
few steps on the tiny model, with IcePop, C3PO++ and rl.async_lag on."""

import json

import pytest

from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.stages.rl import run_rl
from rlrecipe.trajectory.record import Status
from tests.helpers import rl_recipe, write_tiny_data

OPTIONS = {
    "dynamic_sampling": {"dynamic_sampling": {"enabled": True, "max_extra_prompts": 2}},
    "overlong": {"overlong": {"filter": True, "cache": 10, "penalty": 1.0}},
    "qae": {"adv_norm": "group_quantile"},
    "dr_grpo": {"adv_norm": "group_mean"},
    "all": {"dynamic_sampling": {"enabled": True}, "overlong": {"filter": True, "cache": 10},
            "adv_norm": "group_quantile"},
}


def _verdict_by_tokens(batch, tokenizer, grader):
    """The untrained model is never right; this stand-in grader is, for about a third of its
    responses (decided by the tokens, so the same response gets the same verdict), which gives
    groups with and without signal."""
    for t in batch:
        t.correct = t.status == Status.FINISHED or sum(t.response_ids) % 3 == 0


@pytest.mark.parametrize("name", OPTIONS)
def test_option_runs_with_icepop_c3po_and_async_lag(tmp_path, tiny_model_dir, monkeypatch, name):
    monkeypatch.setattr("rlrecipe.stages.rl.grade_trajectories", _verdict_by_tokens)
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=3, save_every=3, async_lag=1, **OPTIONS[name])
    spec["eval"] = {}
    recipe = recipe_from_dict(spec)
    assert recipe.rl.icepop.mode == "icepop" and recipe.rl.c3po.enabled and recipe.rl.async_lag == 1
    run_rl(LoadedRecipe(recipe=recipe, path=f"{name}.yaml"))
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["tokens_trained"] >= 300 for r in rows)  # Phi = 300
    assert all(0 <= r["icepop_masked_frac"] <= 1 and r["rollout_lag"] <= 1 for r in rows)
    cfg = recipe.rl
    if cfg.dynamic_sampling.enabled:
        assert all(r["ds_groups_judged"] == r["ds_groups_dropped"] + r["ds_groups_over_cap"]
                   + round(r["ds_signal_share"] * r["ds_groups_judged"])
                   for r in rows)
        assert sum(r["ds_groups_dropped"] for r in rows) > 0 and all(r["ds_signal_share"] > 0 for r in rows)
    if cfg.overlong.filter:
        # the untrained model rarely says eos: most responses are truncated, and they are the ones filtered
        assert all(r["overlong_filtered_frac"] == r["truncated_frac"] > 0 for r in rows)
    if cfg.overlong.cache:
        # a response truncated at max_new_tokens gets the whole penalty, one that ended inside the
        # last 10 tokens part of it
        assert all(-1 <= r["overlong_penalty_mean"] <= -r["truncated_frac"] for r in rows)
    if cfg.adv_norm in ("group_mean", "group_quantile"):
        assert all(0 < r["adv_zero_frac"] < 1 for r in rows)


class _Stop(Exception):
    pass


def test_a_dynamic_run_stopped_after_a_checkpoint_resumes_to_the_same_metrics(tmp_path, tiny_model_dir, monkeypatch):
    """The pool's checkpoint and the batches collected ahead beside it: the resumed run is the
    uninterrupted one, metric for metric (held rollouts: tests/algo/test_dapo_baselines.py)."""
    from rlrecipe.stages import rl as stage

    monkeypatch.setattr("rlrecipe.stages.rl.grade_trajectories", _verdict_by_tokens)
    data = write_tiny_data(tmp_path / "data")

    def loaded(root):
        spec = rl_recipe(root, data, str(tiny_model_dir), steps=4, save_every=2, async_lag=1, **OPTIONS["all"])
        spec["eval"] = {}
        return LoadedRecipe(recipe=recipe_from_dict(spec), path="all.yaml")

    run_rl(loaded(tmp_path / "a"))
    save = stage.save_rl_checkpoint

    def save_then_stop(run, step, *args):
        save(run, step, *args)
        if step == 2:
            raise _Stop

    monkeypatch.setattr(stage, "save_rl_checkpoint", save_then_stop)
    with pytest.raises(_Stop):
        run_rl(loaded(tmp_path / "b"))
    monkeypatch.setattr(stage, "save_rl_checkpoint", save)
    run_rl(loaded(tmp_path / "b"), resume=True)

    def untimed(root):
        rows = [json.loads(x) for x in (root / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "gen_tokens_per_s"} for r in rows]

    a, b = untimed(tmp_path / "a"), untimed(tmp_path / "b")
    assert len(a) == 4 and a == b
