"""rollout.colocate through the RL loop with the in-process engine: every hand-over runs, is timed,
changes nothing the run computes, and a run stopped in any phase resumes to the same result."""

from __future__ import annotations

import json

import pytest
import torch

from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.rl.colocate import PHASES
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.stages.rl import run_rl
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.helpers import rl_recipe, write_tiny_data


class _Stop(Exception):
    pass


def _loaded(root, data, model, colocate: bool, **rl) -> LoadedRecipe:
    spec = rl_recipe(root, data, str(model), steps=4, save_every=2, eval_every=2, **rl)
    spec["rollout"]["colocate"] = colocate
    return LoadedRecipe(recipe=recipe_from_dict(spec), path="colocated.yaml")


def _rows(root) -> list[dict]:
    return [json.loads(x) for x in (root / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "gen_tokens_per_s"} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The same recipe split and colocated, uninterrupted."""
    root = tmp_path_factory.mktemp("colocated")
    data = write_tiny_data(root / "data")
    run_rl(_loaded(root / "split", data, tiny_model_dir, False))
    run_rl(_loaded(root / "colocated", data, tiny_model_dir, True))
    return root, data


def test_colocated_trains_what_the_split_layout_trains_and_times_every_phase(runs):
    root, _ = runs
    split, colocated = _rows(root / "split"), _rows(root / "colocated")
    assert len(colocated) == 4
    assert _untimed(colocated) == _untimed(split)  # validation (eval_every 2) included
    assert "val/tiny/avg" in colocated[1]
    for row in colocated:
        assert all(row[f"colocate/{p}"] > 0 for p in PHASES), row
    assert not any(k.startswith("colocate/") for k in split[0])


@pytest.mark.parametrize("method", ["release_memory", "reload_states", "offload_states", "resume_memory",
                                    "update_weights_from_state", "verify_push"])
def test_a_run_stopped_in_any_phase_resumes_to_the_same_result(runs, tiny_model_dir, monkeypatch, method):
    root, data = runs
    owner = InProcessEngine if method in ("release_memory", "resume_memory", "update_weights_from_state",
                                          "verify_push") else type_of_trainer()
    real = getattr(owner, method)
    other = root / f"stopped_{method}"
    checkpoint = other / "runs" / "rl" / "checkpoints" / "step_0000002"

    def stop_after_the_checkpoint(self, *args, **kwargs):
        if checkpoint.exists():  # the first call once step 2's checkpoint is written
            raise _Stop
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, stop_after_the_checkpoint)
    with pytest.raises(_Stop):
        run_rl(_loaded(other, data, tiny_model_dir, True))
    monkeypatch.setattr(owner, method, real)
    run_rl(_loaded(other, data, tiny_model_dir, True), resume=True)
    assert _untimed(_rows(other)) == _untimed(_rows(root / "colocated"))


def type_of_trainer():
    from rlrecipe.train.torch_engine import TorchTrainEngine

    return TorchTrainEngine


# -- the in-process engine's side, rule by rule ---------------------------------------------------
@pytest.fixture()
def engine(tiny_model_dir):
    return InProcessEngine(tiny_model_dir, eos_token_id=1, pad_token_id=0, dtype="float32", max_batch=4)


def _generate(engine):
    t = Trajectory("t", [5, 6, 7], "g")
    return engine.generate([t], SamplingParams(max_new_tokens=3), seed=0)


def test_a_released_engine_refuses_to_generate_until_resumed_and_pushed(engine):
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.release_memory()
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the weights' storage is gone
    with pytest.raises(RuntimeError, match="kv_cache, weights released"):
        _generate(engine)
    engine.resume_memory(["weights"])
    assert all(torch.isnan(p).all() for p in engine.model.parameters())  # garbage, not the old weights
    with pytest.raises(RuntimeError, match="kv_cache released"):
        _generate(engine)
    engine.resume_memory(["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="never pushed"):
        _generate(engine)
    with pytest.raises(RuntimeError, match="tensors differ"):
        engine.verify_push(1, state_dict=state)  # nothing landed yet
    engine.update_weights_from_state(state, version=1)
    engine.verify_push(1, state_dict=state)
    assert _generate(engine)[0].response_ids


def test_release_and_resume_keep_to_sglangs_order(engine):
    with pytest.raises(RuntimeError, match="not released"):
        engine.resume_memory(["weights"])
    engine.release_memory(["kv_cache"])
    with pytest.raises(RuntimeError, match="already released"):
        engine.release_memory(["kv_cache", "weights"])
    with pytest.raises(ValueError, match="memory tags"):
        engine.release_memory(["optimizer"])
    engine.release_memory(["weights"])
    with pytest.raises(RuntimeError, match="while the weights are released"):
        engine.update_weights_from_state({}, version=1)


# -- the recipe ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "message"), [
    ({"rl": {"async_lag": 1}}, "nothing to overlap"),
    ({"rollout": {"weight_update_every": 2}}, "every step pushes"),
    ({"rollout": {"engine": "sglang", "sglang": {"weight_sync": "distributed"}}}, "two ranks on one GPU"),
    ({"rollout": {"engine": "sglang", "sglang": {"num_servers": 2}}}, "make them equal"),
])
def test_the_recipe_refuses_what_cannot_share_a_gpu(extra, message):
    spec = {"run": {"name": "r"}, "model": {"tiny": {}}, "rl": {}, "rollout": {"colocate": True}}
    for section, fields in extra.items():
        spec[section] = {**spec[section], **fields}
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(spec)


@pytest.mark.parametrize(("rollout", "trainer", "message"), [
    ({"urls": ["http://10.0.0.7:30000"]}, {}, "rollout.urls http://10.0.0.7:30000"),
    ({"sglang": {"nodes": 2, "num_servers": 2}}, {}, "2 nodes"),
    ({}, {"nodes": 2}, "2 nodes"),
    ({"sglang": {"num_servers": 2}}, {"nproc": 1}, "2 server GPUs"),
    ({"sglang": {"dp_size": 2}}, {"nproc": 2}, "dp_size 2"),
])
def test_a_push_by_handle_is_refused_where_a_server_is_on_another_machine(rollout, trainer, message):
    def spec(rollout: dict, trainer: dict) -> dict:
        sglang = {"weight_sync": "ipc", **rollout.get("sglang", {})}
        return {"run": {"name": "r"}, "model": {"tiny": {}}, "rl": {}, "trainer": trainer,
                "rollout": {"engine": "sglang", **rollout, "sglang": sglang}}

    with pytest.raises(RecipeError, match=f"weight_sync: ipc with {message}"):
        recipe_from_dict(spec(rollout, trainer))
    # servers on this machine, or colocated on every node (each server reads the rank on its own GPU)
    recipe_from_dict(spec({"urls": ["http://127.0.0.1:30000", "localhost:30001"]}, {}))
    recipe_from_dict(spec({"colocate": True, "sglang": {"nodes": 2, "num_servers": 2}}, {"nodes": 2, "nproc": 1}))


# -- through `rlrecipe serve`, as tiny_rl_colocated.yaml runs ---------------------------------------
def _served(root, data, model, port: int) -> dict:
    spec = rl_recipe(root, data, str(model), steps=4, save_every=2, eval_every=2)
    spec["rollout"] = {"engine": "sglang", "colocate": True, "dtype": "float32", "max_new_tokens": 40, "sglang": {
        "base_port": port, "weight_sync": "tensor", "startup_timeout_s": 120,
        "launch_cmd": ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}",
                       "--enable-memory-saver"]}}
    return spec


@pytest.mark.slow
def test_colocated_through_rlrecipe_serve_trains_evaluates_and_resumes_after_a_kill(tmp_path, tiny_model_dir):
    import os
    import subprocess
    import sys

    from tests.helpers import beside, kill_once_checkpointed, write_recipe
    from tests.rollout.test_sglang_client import free_port

    data = write_tiny_data(tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "rl"]
    port_a = free_port()
    port_b = next(p for p in iter(free_port, None) if p != port_a)  # the two runs' servers are up together
    ref = write_recipe(tmp_path / "a.yaml", _served(tmp_path / "a", data, tiny_model_dir, port_a))
    other = write_recipe(tmp_path / "b.yaml", _served(tmp_path / "b", data, tiny_model_dir, port_b))
    run = tmp_path / "b" / "runs" / "rl"
    with beside([*cmd, str(ref)], tmp_path / "a.log", env=env):  # the uninterrupted run, beside the killed one
        # killed once step 2's checkpoint exists, then resumed: a server samples from its own seed stream
        # (and C3PO++'s aborts land where HTTP timing puts them), so the same run to the bit is the
        # in-process tests' (above); here the resumed run starts from the checkpoint and completes
        kill_once_checkpointed([*cmd, str(other)], env, run / "checkpoints" / "step_0000002")
        kept = _rows(tmp_path / "b")[:2]
        out = subprocess.run([*cmd, str(other), "--resume"], check=True, env=env, timeout=600, capture_output=True,
                             text=True)
    rows = _rows(tmp_path / "a")
    assert len(rows) == 4 and "val/tiny/avg" in rows[1] and "val/tiny/avg" in rows[3]
    assert all(r[f"colocate/{p}"] > 0 for r in rows for p in PHASES)
    log = (tmp_path / "a" / "runs" / "rl" / "sglang_server_0.log").read_text()
    # each of 4 steps: released, weights resumed and pushed by tensor, then the KV cache resumed; each
    # checkpoint (after steps 2 and 4) releases again while the trainer's state is saved, and the one
    # the run goes on from pushes again
    assert log.count("release_memory_occupation ['kv_cache', 'weights', 'cuda_graph']") == 4 + 2
    assert log.count("resume_memory_occupation ['weights']") == 4 + 1
    assert log.count("resume_memory_occupation ['kv_cache', 'cuda_graph']") == 4 + 1
    assert all(f"weight_version={v}" in log for v in (1, 2, 3, 4))
    assert (tmp_path / "a" / "runs" / "rl" / "eval" / "tiny" / "summary.json").exists()

    assert "resumed from" in out.stderr + out.stdout and "step_0000002" in out.stderr + out.stdout
    resumed = _rows(tmp_path / "b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[:2] == kept
    assert all(r[f"colocate/{p}"] > 0 for r in resumed[2:] for p in PHASES) and "val/tiny/avg" in resumed[3]
    assert (run / "final").is_dir()


@pytest.mark.slow
def test_colocated_zero3_on_two_ranks_pushes_each_ranks_handles_to_the_server_on_its_device(tmp_path,
                                                                                           tiny_model_dir):
    """weight_sync: ipc, DeepSpeed ZeRO-3 on 2 ranks, 2 servers of one rank each through `rlrecipe serve`:
    server i maps the shared memory of trainer rank i (its files carry the sender's pid), never bytes
    by value, and every push is verified (a wrong or missing weight fails the run)."""
    import os
    import re
    import subprocess
    import sys

    from tests.helpers import write_recipe
    from tests.rollout.test_sglang_client import free_port

    data = write_tiny_data(tmp_path / "data")
    spec = _served(tmp_path, data, tiny_model_dir, free_port())
    spec["rl"].update(steps=2, save_every=2, eval_every=0)
    spec["rollout"]["sglang"].update(weight_sync="ipc", num_servers=2)
    spec["trainer"].update(engine="deepspeed", nproc=2, zero_stage=3)
    path = write_recipe(tmp_path / "ipc.yaml", spec)
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rl", str(path)], check=True, timeout=600,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    senders = []
    for i in (0, 1):
        log = (tmp_path / "runs" / "rl" / f"sglang_server_{i}.log").read_text()
        assert "by value" not in log
        pids = set(re.findall(r"tensors by handle from /torch_(\d+)_", log))
        assert len(pids) == 1, log[-2000:]
        senders.append(pids.pop())
    assert senders[0] != senders[1]  # each server read its own trainer rank's memory
