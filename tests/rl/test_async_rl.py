"""Asynchronous RL (rl.async_lag): batches collected ahead on a worker thread, each under the weights
its schedule names; the same tokens however long each side takes, and an exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, load_recipe, recipe_from_dict
from rlrecipe.rl.ahead import Collected, RolloutAhead, load_pending, save_pending, weights_version
from rlrecipe.rl.rollout_stats import DynamicTally, RolloutStats
from rlrecipe.stages.rl import run_rl
from rlrecipe.trajectory.arrays import TrajectoryBatch
from rlrecipe.trajectory.record import Status, Trajectory
from tests.conftest import REPO
from tests.helpers import beside, kill_once_checkpointed, rl_recipe, write_recipe, write_tiny_data
from tests.ports import free_port

TIMING = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "rollout_collect_s", "rollout_wait_s", "overlap_s",
          "weight_check_s", "step_wall_s", "validation_s", "validation_drain_s"}


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _batch(step: int) -> TrajectoryBatch:
    t = Trajectory(uid=f"u{step}", prompt_ids=[1, 2, 3], group_id=f"g{step}")
    for k in range(step + 1):
        t.append(4 + k, -0.25 * k, step)
    t.status, t.reward, t.correct = Status.FINISHED, 5.0, True
    return TrajectoryBatch.from_trajectories([t])


# -- the schedule -------------------------------------------------------------------------------
def test_the_weights_of_a_batch_follow_from_its_step():
    assert [weights_version(s, 1) for s in range(4)] == [0, 0, 1, 2]
    assert [weights_version(s, 3) for s in range(6)] == [0, 0, 0, 0, 1, 2]


def test_the_worker_installs_then_collects_in_step_order_however_slowly():
    events, engine = [], {"version": 0}
    main_thread = threading.get_ident()

    def collect(step):
        assert threading.get_ident() != main_thread  # on the worker
        time.sleep(0.02 * (3 - step))  # earlier steps take longer: order must still hold
        events.append(("collect", step, engine["version"]))
        return _batch(step), RolloutStats(generated_tokens=step + 1)

    def install(weights, version):
        events.append(("install", version))
        engine["version"] = version

    ahead = RolloutAhead(collect, install, lambda: engine["version"])
    ahead.schedule(0)
    ahead.schedule(1)
    ahead.schedule(2, weights="w1", version=1)
    with pytest.raises(RuntimeError, match="already scheduled"):
        ahead.schedule(2)
    got, waited = ahead.take(0)
    assert (got.step, got.version, got.roll.generated_tokens) == (0, 0, 1) and waited >= 0
    left = ahead.drain()
    assert [c.step for c in left] == [1, 2] and [c.version for c in left] == [0, 1]
    assert events == [("collect", 0, 0), ("collect", 1, 0), ("install", 1), ("collect", 2, 1)]
    ahead.close()


def test_a_failing_collection_reaches_the_trainer():
    def collect(step):
        raise ValueError(f"server gone at step {step}")

    ahead = RolloutAhead(collect, lambda w, v: None, lambda: 0)
    ahead.schedule(0)
    with pytest.raises(ValueError, match="server gone at step 0"):
        ahead.take(0)
    ahead.close()


def test_pending_batches_round_trip_through_a_checkpoint(tmp_path):
    saved = [Collected(s, _batch(s), RolloutStats(generated_tokens=7 * s, pool_size=s, graded=s,
                                                  dynamic=DynamicTally(judged=s, held=1)), s - 1, 0.5 * s)
             for s in (5, 6)]
    save_pending(tmp_path, saved)
    back = load_pending(tmp_path, range(5, 7))
    assert [(c.step, c.version, c.seconds, c.roll.generated_tokens, c.roll.graded, c.roll.dynamic) for c in back] == \
        [(5, 4, 2.5, 35, 5, DynamicTally(judged=5, held=1)), (6, 5, 3.0, 42, 6, DynamicTally(judged=6, held=1))]
    for a, b in zip(saved, back, strict=True):
        assert a.batch.uids == b.batch.uids and a.batch.group_ids == b.batch.group_ids
        assert all(torch.equal(a.batch.arrays[k], b.batch.arrays[k]) for k in a.batch.arrays)
    with pytest.raises(Exception, match=r"steps \[5, 6\].*needs those of steps \[5, 6, 7\]"):
        load_pending(tmp_path, range(5, 8))


# -- the recipe field -----------------------------------------------------------------------------
def test_async_lag_enters_the_sha256_only_when_set():
    base = load_recipe(REPO / "recipes" / "tiny_rl.yaml")
    assert load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rl.async_lag=0"]).sha256 == base.sha256
    lagged = load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rl.async_lag=1"])
    assert lagged.sha256 != base.sha256 and lagged.recipe.experiment_sha256() != base.recipe.experiment_sha256()
    assert "async_lag" not in base.recipe.hashed()["rl"] and lagged.recipe.hashed()["rl"]["async_lag"] == 1


def test_async_lag_refuses_a_second_delay_and_broadcast_into_busy_servers():
    with pytest.raises(RecipeError, match="async_lag and rollout.weight_update_every"):
        load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rl.async_lag=1", "rollout.weight_update_every=2",
                                                        "rl.save_every=2"])
    for sync in ("distributed", "tensor"):
        with pytest.raises(RecipeError, match=f"weight_sync: {sync} would push weights into servers that are"):
            load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["rl.async_lag=2", "rollout.engine=sglang",
                                                            f"rollout.sglang.weight_sync={sync}"])


# -- through the loop -------------------------------------------------------------------------------
@pytest.mark.parametrize("lag", [1, 2])
def test_each_batch_comes_from_the_weights_its_step_names(tmp_path, tiny_model_dir, lag):
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=4, c3po={"enabled": False}, async_lag=lag,
                     save_every=2)
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="async.yaml"))
    rows = _rows(tmp_path / "runs" / "rl")
    assert [r["rollout_version"] for r in rows] == [max(0, s - lag) for s in range(4)]
    # without C3PO++ every token of a batch comes from the one version that collected it
    assert [r["staleness_max"] for r in rows] == [min(s, lag) for s in range(4)]
    assert [r["staleness_tokens"] for r in rows][lag] == [0] * lag + [rows[lag]["tokens_trained"]]
    assert all(r["overlap_s"] >= 0 and r["rollout_wait_s"] >= 0 for r in rows)
    ckpt = tmp_path / "runs" / "rl" / "checkpoints" / "step_0000002"
    pending = sorted(p.name for p in ckpt.glob("pending_step_*"))
    assert pending == [f"pending_step_{s:07d}.safetensors" for s in range(2, 2 + lag)]


def test_a_lagged_run_with_validation_logs_its_wall_clock_without_the_validation(tmp_path, tiny_model_dir):
    # the async study's time axis: step_wall_s per step, the validation's own seconds apart, the drain
    # (the worker's batches ahead finished before validating) inside the step's wall time
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=4, c3po={"enabled": False}, async_lag=2,
                     save_every=4, eval_every=2)
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="async.yaml"))
    rows = _rows(tmp_path / "runs" / "rl")
    assert all(r["step_wall_s"] > 0 for r in rows)
    validated = [r for r in rows if "validation_s" in r]
    assert [r["step"] for r in validated] == [2, 4] and all("val/tiny/avg" in r for r in validated)
    assert all(r["validation_s"] > 0 and r["validation_drain_s"] >= 0 for r in validated)


def test_staleness_with_c3po_stays_within_lag_plus_pool_age(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=5, async_lag=2, save_every=5)
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="async.yaml"))
    rows = _rows(tmp_path / "runs" / "rl")
    bound = 2 + spec["rl"]["c3po"]["max_staleness"]
    assert all(r["staleness_max"] <= bound for r in rows), [r["staleness_max"] for r in rows]
    assert max(r["staleness_max"] for r in rows) > 2  # partial rollouts do carry older tokens
    assert all(sum(r["staleness_tokens"]) == r["tokens_trained"] for r in rows)



def test_the_token_staleness_bound_holds_across_lag_and_resumed_rollouts(tmp_path, tiny_model_dir):
    """The run above with rl.max_token_staleness 2 (eta) at lag 2: no rollout may wait in the pool, so
    every token trains exactly 2 versions behind once the lag is reached, never 3."""
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=5, async_lag=2, save_every=5, max_token_staleness=2)
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="async.yaml"))
    rows = _rows(tmp_path / "runs" / "rl")
    assert [r["staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert sum(r["dropped"] for r in rows) > 0  # rollouts the pool would have resumed were dropped


def test_the_token_staleness_bound_leaves_the_pool_what_the_lag_does_not_use():
    def limit(**rl):
        return recipe_from_dict({"run": {"name": "r"}, "model": {"tiny": {}}, "rl": rl}).rl.rollout_age_limit

    assert limit(c3po={"max_staleness": 3}) == 3  # no eta: sigma
    assert limit(c3po={"max_staleness": 3}, async_lag=1, max_token_staleness=2) == 1
    assert limit(c3po={"max_staleness": 1}, async_lag=1, max_token_staleness=5) == 1  # sigma is the tighter
    assert limit(c3po={"max_staleness": 3}, async_lag=2, max_token_staleness=2) == 0
    with pytest.raises(RecipeError, match="max_token_staleness 1 is below async_lag 2"):
        limit(async_lag=2, max_token_staleness=1)

@pytest.mark.slow
def test_a_killed_async_run_resumes_to_the_same_metrics_and_weights(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def spec(root):
        s = rl_recipe(root, data, str(tiny_model_dir), steps=5, async_lag=2, save_every=1)
        s["eval"] = {}
        return s

    ref = write_recipe(tmp_path / "a.yaml", spec(tmp_path / "a"))
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "rl"]
    other = write_recipe(tmp_path / "b.yaml", spec(tmp_path / "b"))
    run = tmp_path / "b" / "runs" / "rl"
    with beside([*cmd, str(ref)], tmp_path / "a.log", env=env):  # the uninterrupted reference
        kill_once_checkpointed([*cmd, str(other)], env, run / "checkpoints" / "step_0000002")
        subprocess.run([*cmd, str(other), "--resume"], check=True, env=env, timeout=600, capture_output=True)
    assert _untimed(_rows(run)) == _untimed(_rows(tmp_path / "a" / "runs" / "rl"))
    a = load_file(str(tmp_path / "a" / "runs" / "rl" / "final" / "model.safetensors"))
    b = load_file(str(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_async_rl_through_rlrecipe_serve_with_disk_weight_sync(tmp_path, tiny_model_dir):
    """rollout.engine sglang with a launched `rlrecipe serve`: lag 2 holds each version's weights in an
    export of its own until the worker loads it, then deletes the older ones."""
    port = free_port()
    data = write_tiny_data(tmp_path / "data")
    recipe = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=5, async_lag=2, c3po={"enabled": False})
    recipe["eval"] = {}
    recipe["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 30, "sglang": {
        "base_port": port, "weight_sync": "disk", "startup_timeout_s": 120,
        "launch_cmd": [sys.executable, "-m", "rlrecipe.cli.app", "serve", "{model}", "--host", "{host}",
                       "--port", "{port}", "--dtype", "{dtype}"]}}
    path = write_recipe(tmp_path / "rl.yaml", recipe)
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rl", str(path)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600, capture_output=True)
    run = tmp_path / "runs" / "rl"
    rows = _rows(run)
    assert [r["rollout_version"] for r in rows] == [0, 0, 0, 1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    log = (run / "sglang_server_0.log").read_text()
    assert "weight_version=1" in log and "weight_version=2" in log and "v0000001" in log
    # the batch of step 5 was collected under version 2's export; version 1's was deleted then
    assert sorted(p.name for p in (run / "weights_for_rollout").glob("v*")) == ["v0000002"]
