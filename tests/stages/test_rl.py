import json
import os
import subprocess
import sys

import pytest

from tests.helpers import beside, kill_once_checkpointed, rl_recipe, write_recipe, write_tiny_data
from tests.ports import free_port

TIMING = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "step_wall_s"}
REQUIRED = {"reward_mean", "accuracy", "response_len_mean", "response_len_max", "truncated_frac", "tokens_trained",
            "tokens_generated", "pool_size", "pool_mean_age", "dropped", "entropy", "grad_norm", "clip_frac",
            "icepop_masked_frac", "mismatch_abs_logp", "mismatch_kl", "rollout_s", "train_s", "gen_tokens_per_s"}


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _rl(recipe, *extra):
    return [sys.executable, "-m", "rlrecipe.cli.app", "rl", str(recipe), *extra]


@pytest.mark.slow
def test_rl_runs_logs_everything_and_resumes_after_a_kill_identically(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = write_recipe(tmp_path / "ref.yaml", rl_recipe(tmp_path / "a", data, str(tiny_model_dir)))
    run = tmp_path / "b" / "runs" / "rl"
    rec = write_recipe(tmp_path / "b.yaml", rl_recipe(tmp_path / "b", data, str(tiny_model_dir)))
    with beside(_rl(ref), tmp_path / "ref.log", env=env):  # the uninterrupted reference
        # the same run, killed once its second checkpoint exists, then resumed
        kill_once_checkpointed(_rl(rec), env, run / "checkpoints" / "step_0000002")
        subprocess.run(_rl(rec, "--resume"), check=True, env=env, timeout=600, capture_output=True)
    ref_metrics = _metrics(tmp_path / "a" / "runs" / "rl")
    assert len(ref_metrics) == 4 and REQUIRED - TIMING <= set(ref_metrics[0])
    assert ref_metrics[0]["mismatch_abs_logp"] > 0  # bf16 rollout vs fp32 trainer
    summary = json.loads((tmp_path / "a" / "runs" / "rl" / "eval" / "tiny" / "summary.json").read_text())
    assert summary["n"] == 2 and summary["num_problems"] == 8
    assert _metrics(run) == ref_metrics


@pytest.mark.slow
def test_rl_through_the_sglang_api_with_broadcast_weight_sync(tmp_path, tiny_model_dir):
    """rollout.engine sglang, servers launched as `rlrecipe serve`, weights broadcast over gloo each step."""
    ports = [free_port(), free_port()]
    data = write_tiny_data(tmp_path / "data")
    recipe = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=3, c3po={"enabled": False})
    recipe["eval"]["benchmarks"] = []
    recipe["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 40, "sglang": {
        "base_port": ports[0], "weight_sync": "distributed", "weight_sync_backend": "gloo",
        "weight_sync_port": ports[1], "startup_timeout_s": 120,
        "launch_cmd": [sys.executable, "-m", "rlrecipe.cli.app", "serve", "{model}", "--host", "{host}",
                       "--port", "{port}", "--dtype", "{dtype}"]}}
    path = write_recipe(tmp_path / "rl.yaml", recipe)
    subprocess.run(_rl(path), check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
                   capture_output=True)
    run = tmp_path / "runs" / "rl"
    rows = _metrics(run)
    assert len(rows) == 3
    assert all((r["rollout_servers_live"], r["rollout_server_restarts"]) == (1, 0) for r in rows)
    # every step's rollouts come from the weights the trainer had when it started the step: the
    # server received each update (fp32 on both sides, so only float noise is left)
    assert all(r["mismatch_abs_logp"] < 1e-4 for r in rows), [r["mismatch_abs_logp"] for r in rows]
    log = (run / "sglang_server_0.log").read_text()
    assert "joined weight update group" in log
    assert [f"weight_version={v}" in log for v in (1, 2)] == [True, True]
    assert "broadcast tensors" in log and not (run / "weights_for_rollout").exists()  # nothing went via disk


def test_a_resumed_run_keeps_counting_an_entropy_streak(tmp_path, tiny_model_dir):
    """An alarm needing 3 steps in a row fires at step 3 also when the run was resumed from step 2's
    checkpoint: the count is restored from the metrics kept, not restarted."""
    import shutil

    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.stages.rl import run_rl

    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=3, ppo_minibatches=1, c3po={"enabled": False},
                     entropy_watch={"low": 1e9, "patience": 3})
    spec["eval"] = {}
    loaded = LoadedRecipe(recipe=recipe_from_dict(spec), path="watch.yaml")
    run_rl(loaded)
    run = tmp_path / "runs" / "rl"
    first = [json.loads(line)["entropy_collapse_alarm"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert first == [0.0, 0.0, 1.0]
    shutil.rmtree(run / "checkpoints" / "step_0000003")  # as if killed before step 3's checkpoint
    run_rl(loaded, resume=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["entropy_collapse_alarm"]) for r in rows] == [(1, 0.0), (2, 0.0), (3, 1.0)]


def test_remedies_that_need_the_loop_run_through_it(tmp_path, tiny_model_dir):
    """KL to a reference (the policy starts at the reference and step 1's single minibatch is taken
    before any update, so its KL is 0 up to rounding; later steps move away) and the entropy watch (a low bound no entropy can pass: alarm from the
    first step with patience 1), on the plain loop, in one process."""
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.stages.rl import run_rl

    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=3, ppo_minibatches=1, kl_coef=0.5, kl_estimator="k3",
                     entropy_watch={"low": 1e9, "patience": 1})
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="kl.yaml"))
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["kl_ref"]) < 1e-6 < rows[2]["kl_ref"]
    assert all(r["entropy_collapse_alarm"] == 1.0 and r["entropy_explosion_alarm"] == 0.0 for r in rows)
