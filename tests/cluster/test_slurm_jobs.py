"""The batch scripts `rlrecipe slurm` writes, submitted unchanged with `sbatch` to a real Slurm of two
nodes on this machine (127.0.0.1 and 127.0.0.2; `make slurm-local`): CPU, gloo, DeepSpeed ZeRO-2 and
`rlrecipe serve` servers.

- split: node 127.0.0.1 trains (2 ranks), 127.0.0.2 serves and takes the trainer's weight pushes;
- colocated: both nodes train (ZeRO-2 across them) and each serves;
- SFT over two nodes;
- faults as Slurm delivers them: every process of a node killed mid-run, the job requeued, the job
  cancelled; a run stopped for a resumable cause is run again by the job itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlrecipe.cluster.node import URLS_FILE, read_urls
from tests.cluster.jobs import job_recipe, metrics, sglang_servers, untimed_rows
from tests.cluster.slurm import Job, job_output, job_processes, kill_node, slurm_env, submit, wait_until
from tests.helpers import write_recipe, write_tiny_data
from tests.ports import free_ports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    return slurm_env()


def write_job(recipe: Path, gpus_per_node: int, *extra: str) -> Path:
    """`rlrecipe slurm` as a user runs it; the script lands beside the recipe."""
    out = recipe.parent / "job.sbatch"
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "slurm", str(recipe), "--gpus-per-node",
                    str(gpus_per_node), "--assume-shared", "--out", str(out), *extra],  # tmp is one machine's disk
                   check=True, capture_output=True, text=True)
    return out


def test_split_job_one_training_node_one_rollout_node(slurm, tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = job_recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 2},
                        rollout=sglang_servers(free_ports(1), nodes=1, servers=1))
    rc, job = submit(write_job(recipe, 2), slurm)
    out = job_output(recipe.parent, job)
    assert rc == 0, out[-4000:]
    run = tmp_path / "job" / "runs" / "rl"
    assert [r["step"] for r in metrics(run)] == [1, 2] and (run / "final").is_dir()
    assert "node 0 of 2 (127.0.0.1): train" in out and "node 1 of 2 (127.0.0.2): rollout" in out
    served = (run / "rollout_node0" / "sglang_server_0.log").read_text()
    # the rollout node's server, bound where the training node reaches it, took the pushed weights
    assert "ready on http://127.0.0.2:" in served and "weight_version=2" in served
    assert read_urls(run / URLS_FILE) == []  # stopped with the job: its URL taken out again
    assert job_processes(job) == []


def test_colocated_job_two_nodes_each_training_and_serving(slurm, tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = job_recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 1, "nodes": 2},
                        rollout={**sglang_servers(free_ports(2), nodes=2, servers=2, flags=["--enable-memory-saver"]),
                                 "colocate": True})
    rc, job = submit(write_job(recipe, 1), slurm)
    out = job_output(recipe.parent, job)
    assert rc == 0, out[-4000:]
    run = tmp_path / "job" / "runs" / "rl"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and all(r["colocate/update_s"] > 0 for r in rows)
    for share, host in enumerate(("127.0.0.1", "127.0.0.2")):  # released, given the weights, resumed each step
        log = (run / f"rollout_node{share}" / f"sglang_server_{share}.log").read_text()
        assert f"ready on http://{host}:" in log
        assert "weight_version=2" in log and "release_memory_occupation" in log


def test_sft_over_two_nodes(slurm, tmp_path):
    from tests.stages.test_sft import sft_recipe

    data = write_tiny_data(tmp_path / "data", n=48)
    spec = sft_recipe(tmp_path / "job", data, "sft")
    spec["trainer"] = {**spec["trainer"], "engine": "deepspeed", "zero_stage": 2, "nproc": 1, "nodes": 2}
    spec["sft"]["max_steps"] = 3
    (tmp_path / "job").mkdir()
    recipe = write_recipe(tmp_path / "job" / "sft.yaml", spec)
    rc, job = submit(write_job(recipe, 1, "--stage", "sft"), slurm)
    out = job_output(recipe.parent, job)
    assert rc == 0, out[-4000:]
    run = tmp_path / "job" / "runs" / "sft"
    assert [r["step"] for r in metrics(run)] == [1, 2, 3] and (run / "final").is_dir()
    assert "node 0 of 2 (127.0.0.1): train" in out and "node 1 of 2 (127.0.0.2): train" in out


STEPS = 12  # long enough that a fault at step 2's checkpoint lands while both nodes still train


def _in_process(tmp_path: Path, tiny_model_dir, name: str) -> Path:
    """Two training nodes of one rank (ZeRO-2 across them), rollouts in-process: sampling is the
    trainer's own, so a resumed run repeats an uninterrupted one exactly."""
    data = write_tiny_data(tmp_path / "data")
    return job_recipe(tmp_path / name, data, tiny_model_dir, trainer={"nproc": 1, "nodes": 2}, rollout={},
                      steps=STEPS)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, tiny_model_dir):
    """The metrics of the in-process job run whole, through the same Slurm."""
    tmp = tmp_path_factory.mktemp("whole")
    recipe = _in_process(tmp, tiny_model_dir, "whole")
    rc, job = submit(write_job(recipe, 1), slurm)
    assert rc == 0, job_output(recipe.parent, job)[-4000:]
    return untimed_rows(tmp / "whole" / "runs" / "rl")


def _cut_at_step_2(job: Job, run: Path, recipe: Path) -> None:
    wait_until(lambda: (run / "checkpoints" / "step_0000002").exists() or not job.queued(), 600,
               "step 2's checkpoint")
    assert job.queued(), job_output(recipe.parent, job.id)[-4000:]


def test_a_node_killed_mid_run_the_job_resumes_by_itself_to_the_same_metrics(slurm, uninterrupted, tmp_path,
                                                                           tiny_model_dir):
    recipe = _in_process(tmp_path, tiny_model_dir, "cut")
    run = tmp_path / "cut" / "runs" / "rl"
    job = Job(write_job(recipe, 1), slurm)
    _cut_at_step_2(job, run, recipe)
    assert kill_node(job.id, "127.0.0.2") > 0  # every process of node 2's step: cluster-node, stage, torchrun, rank
    assert not (run / "checkpoints" / f"step_{STEPS:07d}").exists()  # mid-run
    rc = job.wait()
    out = job_output(recipe.parent, job.id)
    assert rc == 0, out[-4000:]
    assert "running it again with --resume (1 of 3)" in out
    assert untimed_rows(run) == uninterrupted


def test_a_requeued_job_resumes_to_the_same_metrics(slurm, uninterrupted, tmp_path, tiny_model_dir):
    recipe = _in_process(tmp_path, tiny_model_dir, "requeued")
    run = tmp_path / "requeued" / "runs" / "rl"
    job = Job(write_job(recipe, 1), slurm)
    _cut_at_step_2(job, run, recipe)
    job.requeue()
    rc = job.wait()
    out = job_output(recipe.parent, job.id)
    assert rc == 0, out[-4000:]
    assert "DUE TO JOB REQUEUE" in out
    assert untimed_rows(run) == uninterrupted


def test_a_cancelled_job_leaves_no_process_on_either_node(slurm, tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = job_recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 2},
                        rollout=sglang_servers(free_ports(1), nodes=1, servers=1), steps=200)
    job = Job(write_job(recipe, 2), slurm)
    run = tmp_path / "job" / "runs" / "rl"
    wait_until(lambda: metrics(run) or not job.queued(), 600, "the first step")
    running = {p.environ().get("SLURMD_NODENAME") for p in job_processes(job.id)}
    assert running == {"127.0.0.1", "127.0.0.2"}, job_output(recipe.parent, job.id)[-4000:]
    job.cancel()
    wait_until(lambda: not job_processes(job.id), 60, "the job's processes gone", poll_s=0.5)


FAKE_NODE = """#!/bin/bash
# stands in for rlrecipe: records its arguments, exits with the next of the codes given
n=$(wc -l < "$0.calls" 2>/dev/null || echo 0)
echo "$*" >> "$0.calls"
codes=({codes})
exit ${{codes[$n]}}
"""


@pytest.mark.parametrize("codes, status, calls", [
    ([75, 0], 0, 2),  # a resumable stop (a cut broadcast, say): run again with --resume
    ([1, 1, 1], 1, 3),  # failing every try: given up after --retries
    ([2, 0], 2, 1),  # a mistake in the recipe: another try would fail the same way
])
def test_the_job_runs_a_failed_training_step_again_unless_the_recipe_is_at_fault(slurm, tmp_path, tiny_model_dir,
                                                                                codes, status, calls):
    recipe = job_recipe(tmp_path / "job", write_tiny_data(tmp_path / "data"), tiny_model_dir,
                        trainer={"nproc": 1}, rollout={})
    fake = tmp_path / "fake-rlrecipe"
    fake.write_text(FAKE_NODE.format(codes=" ".join(map(str, codes))))
    fake.chmod(0o755)
    rc, job = submit(write_job(recipe, 1, "--retries", "2"), {**slurm, "RLRECIPE": str(fake)})
    assert rc == status, job_output(recipe.parent, job)
    made = Path(f"{fake}.calls").read_text().splitlines()
    assert len(made) == calls and all(a.startswith("cluster-node ") for a in made)
    assert ["--resume" in a for a in made] == [False] + [True] * (calls - 1)


def test_a_cut_broadcast_exits_with_the_status_the_job_runs_again():
    from rlrecipe.cluster.sbatch import RECIPE_ERROR
    from rlrecipe.rollout.sglang.broadcast import BroadcastCut

    assert BroadcastCut.exit_code not in (0, RECIPE_ERROR)
