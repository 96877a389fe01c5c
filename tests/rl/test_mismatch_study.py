"""The mismatch study: its dials (logit noise, weight-update lag; precision is rollout.dtype), its recipes and
its summary."""

import json

import pytest
import torch

from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import recipe_from_dict
from tests.helpers import flat_recipe, recipe_changes, rl_recipe, write_tiny_data


# -- the noise dial --------------------------------------------------------------------------
def test_noisy_sample_records_the_perturbed_distribution():
    """logp_infer is the log-prob under softmax((logits + sigma * eps) / T), eps drawn from the
    noise generator, computed here by hand from the same draws."""
    from rlrecipe.rollout.inprocess import InProcessEngine
    from rlrecipe.trajectory.record import SamplingParams

    logits = torch.tensor([[4.0, 1.0, 0.0, -2.0], [0.5, 0.5, 3.0, 0.0]])
    params = SamplingParams(temperature=0.7, logit_noise=1.5)
    tok, lp = InProcessEngine._sample(object.__new__(InProcessEngine), logits, params,
                                      torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(9))
    eps = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    expected = torch.log_softmax((logits + 1.5 * eps) / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected)
    clean = torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert (lp - clean).abs().max() > 0.05  # the record differs from the clean policy's


def test_noise_leaves_the_sampling_stream_alone_and_opens_a_real_gap(tiny_model_dir):
    """sigma = 0 samples exactly as before the dial existed; sigma > 0 makes the engine's recorded
    log-probs depart from the trainer's (both float32 on the same weights), more with more noise."""
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.rollout.inprocess import InProcessEngine
    from rlrecipe.train.base import TrainSample
    from rlrecipe.trajectory.record import SamplingParams, Trajectory

    tok = load_tokenizer(tiny_model_dir)
    engine = InProcessEngine(tiny_model_dir, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=8)
    prompt = tok("12+34=")["input_ids"]

    def roll(sigma):
        trajs = [Trajectory(uid=str(i), prompt_ids=list(prompt)) for i in range(6)]
        return engine.generate(trajs, SamplingParams(max_new_tokens=12, logit_noise=sigma), seed=5)

    plain, zero = roll(0.0), roll(0.0)
    assert [t.response_ids for t in plain] == [t.response_ids for t in zero]
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.recipe.training import ModelSection
    from rlrecipe.train import make_train_engine

    train = make_train_engine(TrainerSection(), ModelSection(dtype="float32"), tiny_model_dir, 1)

    def gap(trajs):
        samples = [TrainSample(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]
        lps = [lp for lp, _ in train.compute_logprobs(samples)]
        return float(torch.cat([(lp - torch.tensor(t.logp_infer)).abs() for lp, t in zip(lps, trajs, strict=True)]).mean())

    g0, g1, g4 = gap(plain), gap(roll(1.0)), gap(roll(4.0))
    assert g0 < 1e-4 < g1 < g4, (g0, g1, g4)


# -- the recipes' checks -----------------------------------------------------------------------
def _spec(tmp_path, **rollout):
    spec = rl_recipe(tmp_path, tmp_path, "run:x")
    spec["rollout"].update(rollout)
    return spec


def test_lag_must_divide_the_checkpoint_interval(tmp_path):
    spec = _spec(tmp_path, weight_update_every=3)
    spec["rl"]["save_every"] = 4
    with pytest.raises(RecipeError, match=r"rl.save_every \(4\).*rollout.weight_update_every \(3\)"):
        recipe_from_dict(spec)
    spec["rl"]["save_every"] = 6
    assert recipe_from_dict(spec).rollout.weight_update_every == 3


def test_noise_is_refused_outside_the_inprocess_engine(tmp_path):
    with pytest.raises(RecipeError, match="stress_logit_noise"):
        recipe_from_dict(_spec(tmp_path, engine="sglang", stress_logit_noise=1.0))


# -- the lag dial, through the loop -------------------------------------------------------------
def test_weight_update_lag_shows_as_staleness(tmp_path, tiny_model_dir):
    """Synchronous rollout, weights pushed after every 2nd step: steps 2 and 4 train on rollouts of
    the weights one update old (staleness 1), steps 1 and 3 on current ones (0)."""
    from rlrecipe.recipe.schema import LoadedRecipe
    from rlrecipe.stages.rl import run_rl

    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=4, save_every=2, c3po={"enabled": False})
    spec["rollout"]["weight_update_every"] = 2
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="lag.yaml"))
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["staleness_max"], r["staleness_mean"]) for r in rows] == [(0, 0.0), (1, 1.0), (0, 0.0), (1, 1.0)]


# -- the study's recipes -------------------------------------------------------------------------
ARMS = {
    "tis": {"rl.icepop.mode": "tis"},
    "icepop": {"rl.icepop.mode": "icepop"},
    "seqmask": {"rl.offpolicy_seq_delta": 0.1},
    "gspo": {"rl.ratio_level": "sequence", "rl.loss_agg": "seq_mean_token_mean"},
}


@pytest.mark.parametrize("arm", ARMS)
def test_study_arms_differ_only_in_the_correction(arm):
    changed = recipe_changes("mismatch_off.yaml", f"mismatch_{arm}.yaml")
    base = flat_recipe("mismatch_off.yaml")
    assert changed.pop("run.name") == f"mismatch-{arm}"
    assert changed == ARMS[arm]
    assert base["rl.icepop.mode"] == "off" and base["rl.offpolicy_seq_delta"] is None


# -- the study's summary ---------------------------------------------------------------------------
def _write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step, acc, grad=1.0, masked=0.0, kl=0.0):
    return {"step": step, "reward_mean": 10 * acc - 5, "accuracy": acc, "grad_norm": grad, "icepop_masked_frac": masked,
            "mismatch_kl": kl, "entropy": 0.1, "response_len_mean": 40.0}


def test_study_summary_by_hand(tmp_path):
    from scripts.mismatch_study import aggregate, summarise_run

    # 10 steps: accuracy 0.6 for the first 5 and 0.45 for the last 5 -> a drop of 0.15 > 0.10: collapse
    falling = tmp_path / "a"
    _write_metrics(falling, [_row(i + 1, 0.6 if i < 5 else 0.45, grad=float(i), kl=0.01 * i) for i in range(10)])
    a = summarise_run(falling, "off", "noise", 2.0, 1, "done")
    assert a["accuracy_first"] == pytest.approx(0.6) and a["accuracy_final"] == pytest.approx(0.45)
    assert a["reward_final"] == pytest.approx(-0.5) and a["grad_norm_max"] == 9.0
    assert a["mismatch_kl_mean"] == pytest.approx(0.045) and a["collapsed"]
    # a drop of exactly 0.05 is not a collapse; a run that stopped is one whatever its numbers
    steady = tmp_path / "b"
    _write_metrics(steady, [_row(i + 1, 0.6 if i < 5 else 0.55, masked=0.2) for i in range(10)])
    b = summarise_run(steady, "off", "noise", 2.0, 2, "done")
    assert not b["collapsed"] and summarise_run(steady, "off", "noise", 2.0, 3, "stopped")["collapsed"]
    (table,) = aggregate([a, b])
    assert table["seeds"] == [1, 2] and table["collapsed"] == 1
    assert table["reward_final_mean"] == pytest.approx((-0.5 + 0.5) / 2)
    assert table["reward_final_sd"] == pytest.approx(2 ** 0.5 * 0.5)  # sd of (-0.5, 0.5)
    assert table["grad_norm_max"] == 9.0 and table["masked_frac_mean"] == pytest.approx(0.1)


def test_results_md_gets_the_study_table_and_keeps_study_runs_out_of_the_main_one(tmp_path):
    from rlrecipe.eval.report import render_results_md

    from scripts.mismatch_study import aggregate, summarise_run

    run = tmp_path / "mm-icepop-noise2-s1"
    _write_metrics(run, [_row(i + 1, 0.6, grad=2.5, masked=0.25, kl=0.125) for i in range(6)])
    (run / "recipe.sha256").write_text("ab" * 32)
    row = summarise_run(run, "icepop", "noise", 2.0, 1, "done")
    study = {"plan": {"headline": {"dial": "noise", "level": 2.0}}, "collapse_rule": "RULE", "table": aggregate([row])}
    study_run = {"recipe": "recipes/mismatch_icepop.yaml", "model": "runs/mm/final", "benchmark": "tiny-arith",
                 "avg": 0.5, "n": 8}
    md = render_results_md([study_run], [], study)
    assert "No results are recorded yet" in md  # the study's own evaluation is not a main-table row
    line = next(x for x in md.splitlines() if x.startswith("| noise sigma=2 "))
    assert line == ("| noise sigma=2 | icepop | 1 | 1.00 | - | 2.50 | 0.2500 | 0.1250 | 0 of 1 | "
                    "recipes/mismatch_icepop.yaml | abababababab | - |")
    assert "Collapse: RULE." in md and "Headline (all seeds): noise 2." in md


def test_the_three_dials_summarise_and_sort_together(tmp_path):
    from rlrecipe.eval.study_sections import study_section

    from scripts.mismatch_study import aggregate, run_name, summarise_run

    rows = []
    for dial, level in (("precision", "float16"), ("noise", 10.0), ("noise", 2.0), ("lag", 5)):
        run = tmp_path / run_name("off", dial, level, 1)
        _write_metrics(run, [_row(i + 1, 0.6) for i in range(6)])
        rows.append(summarise_run(run, "off", dial, level, 1, "done"))
    assert [r["run"].split("/")[-1] for r in rows] == ["mm-off-precision-float16-s1", "mm-off-noise10-s1",
                                                       "mm-off-noise2-s1", "mm-off-lag5-s1"]
    table = aggregate(rows)
    assert [(t["dial"], t["level"]) for t in table] == [("lag", 5), ("noise", 2.0), ("noise", 10.0),
                                                         ("precision", "float16")]
    md = study_section({"table": table})
    assert [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        "| lag L=5", "| noise sigma=2", "| noise sigma=10", "| rollout float16"]
