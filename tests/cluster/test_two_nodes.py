"""A Slurm job's node commands run as two "nodes" on this machine (rlrecipe/cluster/node.py), with
SLURM_NODEID, SLURM_PROCID and SLURM_JOB_NODELIST set as Slurm sets them and the rendezvous port as
the batch script exports it: CPU, gloo, DeepSpeed ZeRO-2, `rlrecipe serve` servers.

- split: node 0 trains (2 ranks), node 1 serves; the job's status is the trainer's.
- colocated: both nodes train (one rank each, ZeRO-2 across the nodes) and serve.
- a node's trainer killed mid-run, then the job resubmitted with --resume: the same metrics as an
  uninterrupted job run beside it (in-process rollouts, so sampling is the trainer's own and repeats exactly).
- a rollout node that never comes up: the training node stops in one line, never hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlrecipe.cluster import node as node_module
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import load_recipe
from tests.helpers import rl_recipe, write_recipe, write_tiny_data
from tests.rollout.test_sglang_client import free_port, free_ports

pytestmark = pytest.mark.slow
STANDIN = ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}"]
TIMING = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "step_wall_s"}


def _recipe(root: Path, data: Path, model: Path, *, trainer: dict, rollout: dict, steps: int = 2) -> Path:
    spec = rl_recipe(root, data, str(model), steps=steps, c3po={"enabled": False})
    spec["eval"]["benchmarks"] = []
    spec["trainer"] = {**spec["trainer"], "engine": "deepspeed", "zero_stage": 2, **trainer}
    spec["rollout"] = {**spec["rollout"], **rollout}
    root.mkdir(parents=True, exist_ok=True)
    return write_recipe(root / "rl.yaml", spec)


def _sglang(port: int, nodes: int, servers: int, **extra) -> dict:
    return {"engine": "sglang", "dtype": "float32", "sglang": {
        "base_port": port, "num_servers": servers, "nodes": nodes, "weight_sync": "disk", "startup_timeout_s": 120,
        "launch_cmd": STANDIN + extra.pop("flags", []), **extra}}


def start_nodes(recipe: Path, nodes: int, gpus_per_node: int, port: int, *extra: str,
                only: int | None = None) -> list[subprocess.Popen]:
    """One `rlrecipe cluster-node` per node (`only`: that node alone), as srun starts it: each in its
    own process group."""
    procs = []
    for n in range(nodes) if only is None else [only]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_NODEID": str(n),
               "SLURM_PROCID": str(n), "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes),
               node_module.PORT_ENV: str(port)}
        env.pop("SGLANG_API_KEY", None)
        log = open(recipe.parent / f"node{n}.log", "ab")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, "-m", "rlrecipe.cli.app", "cluster-node", str(recipe),
                                       "--gpus-per-node", str(gpus_per_node), *extra], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen], sig=signal.SIGKILL) -> None:
    """`sig` to each node's process group, as srun signals a step."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        p.wait(timeout=60)


def node_dies(proc: subprocess.Popen) -> None:
    """Every process of a node gone at once (torchrun starts its ranks in sessions of their own, so
    the node's process group alone would leave them running)."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if k not in TIMING}
            for ln in (run / "metrics.jsonl").read_text().splitlines()]


def _log(recipe: Path, n: int) -> str:
    return (recipe.parent / f"node{n}.log").read_text(errors="replace")


def test_split_job_one_training_node_one_rollout_node(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = _recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 2},
                     rollout=_sglang(free_port(), nodes=1, servers=1))
    trainer, rollout = start_nodes(recipe, 2, gpus_per_node=2, port=free_port())
    try:
        assert trainer.wait(timeout=600) == 0, _log(recipe, 0)[-3000:]
        time.sleep(1.0)
        assert rollout.poll() is None  # it serves until the job stops it (the batch script's kill)
    finally:
        stop([rollout], signal.SIGTERM)
    run = tmp_path / "job" / "runs" / "rl"
    assert [r["step"] for r in _rows(run)] == [1, 2] and (run / "final").is_dir()
    assert "node 0 of 2 (127.0.0.1): train" in _log(recipe, 0) and "node 1 of 2 (127.0.0.1): rollout" in _log(recipe, 1)
    served = (run / "rollout_node0" / "sglang_server_0.log").read_text()
    assert "weight_version=2" in served  # the training node pushed its weights to the rollout node's server
    assert node_module.read_urls(run / node_module.URLS_FILE) == []  # stopped: its URL taken out again


def test_colocated_job_two_nodes_each_training_and_serving(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = _recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 1, "nodes": 2},
                     rollout={**_sglang(free_ports(2), nodes=2, servers=2, flags=["--enable-memory-saver"]),
                              "colocate": True})
    procs = start_nodes(recipe, 2, gpus_per_node=1, port=free_port())
    try:
        assert [p.wait(timeout=600) for p in procs] == [0, 0], _log(recipe, 0)[-3000:] + _log(recipe, 1)[-2000:]
    finally:
        stop(procs)
    run = tmp_path / "job" / "runs" / "rl"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["colocate/update_s"] > 0 for r in rows)
    for share in (0, 1):  # each node's server was released, given the weights and resumed every step
        log = (run / f"rollout_node{share}" / f"sglang_server_{share}.log").read_text()
        assert "weight_version=2" in log and "release_memory_occupation" in log


def test_a_node_killed_mid_run_then_the_job_resubmitted_resumes_as_if_uninterrupted(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    trainer = {"nproc": 1, "nodes": 2}
    # long enough that the kill at step 2's checkpoint lands while both nodes still train
    whole = _recipe(tmp_path / "whole", data, tiny_model_dir, trainer=trainer, rollout={}, steps=12)
    cut = _recipe(tmp_path / "cut", data, tiny_model_dir, trainer=trainer, rollout={}, steps=12)
    run = tmp_path / "cut" / "runs" / "rl"
    ports = []  # the uninterrupted job's, the cut job's and the resubmitted job's, all told apart
    for port in iter(free_port, None):
        ports += [port] if port not in ports else []
        if len(ports) == 3:
            break
    # the uninterrupted job runs beside the cut one (a node's rank takes about one core)
    reference = start_nodes(whole, 2, gpus_per_node=1, port=ports[0])
    try:
        procs = start_nodes(cut, 2, gpus_per_node=1, port=ports[1])
        deadline = time.monotonic() + 600
        while not (run / "checkpoints" / "step_0000002").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _log(cut, 0)[-3000:]
            time.sleep(0.05)
        node_dies(procs[1])  # node 1: its cluster-node, stage, torchrun and rank, SIGKILL
        assert not (run / "checkpoints" / "step_0000012").exists()  # mid-run
        # node 0 does not hang on its lost peer: its collective fails and the node exits on its own
        t0 = time.monotonic()
        assert procs[0].wait(timeout=300) != 0
        print(f"node 0 exited {time.monotonic() - t0:.1f}s after node 1 was killed")
        stop(procs)
        procs = start_nodes(cut, 2, 1, ports[2], "--resume")  # resubmitted: a new port
        assert [p.wait(timeout=600) for p in procs] == [0, 0], _log(cut, 0)[-3000:]
        assert [p.wait(timeout=600) for p in reference] == [0, 0], _log(whole, 0)[-3000:]
    finally:
        stop(reference)
    assert _rows(run) == _rows(tmp_path / "whole" / "runs" / "rl")


def test_a_rollout_node_that_never_comes_up_stops_the_training_node_in_one_line(tmp_path, tiny_model_dir,
                                                                              monkeypatch):
    data = write_tiny_data(tmp_path / "data")
    recipe = _recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 2},
                     rollout=_sglang(free_port(), nodes=1, servers=1, startup_timeout_s=1))
    monkeypatch.setattr(node_module, "URLS_GRACE_S", 1.0)
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1", node_module.PORT_ENV: "29999"}
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        node_module.run_node(load_recipe(recipe), [], stage="rl", gpus_per_node=2, resume=False, env=env)
    assert time.monotonic() - t0 < 30
    assert "rollout_urls.yaml: 0 of 1 rollout servers listed after 2s" in str(err.value)
    assert "\n" not in str(err.value)
