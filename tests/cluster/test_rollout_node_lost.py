"""A split job of three "nodes" on this machine (imitated: the real Slurm here has two, and node 2 is
started again alone as an operator would, tests/cluster/imitated_nodes.py): node 0 trains, nodes 1 and 2 each serve one
`rlrecipe serve` server (`retry_on_other_servers`). Node 2 is lost mid-run (every process of it
SIGKILLed), the job goes on with node 1's server; node 2 is started again, as an operator would
with `srun --relative=2`, and the run takes its server back at a push. Pushed over disk with the
real sglang-router in front (the training node launches it), by tensor, and by broadcast (a gloo
group made again without the lost server, and again with it)."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import time

import pytest

from tests.cluster.imitated_nodes import host, node_dies, start_nodes, stop
from tests.cluster.imitated_nodes import node_log as _log
from tests.cluster.jobs import job_recipe as _recipe
from tests.cluster.jobs import metrics as _metrics
from tests.cluster.jobs import sglang_servers as _sglang
from tests.helpers import write_tiny_data
from tests.rollout.router_recovery import ANSI
from tests.rollout.test_sglang_client import free_port, free_ports

pytestmark = pytest.mark.slow
STEPS = 10


def _wait_for_step(run, step: int, procs, recipe) -> None:
    deadline = time.monotonic() + 600
    while len(_metrics(run)) < step:
        assert time.monotonic() < deadline and procs[0].poll() is None, _log(recipe, 0)[-3000:]
        time.sleep(0.05)


@contextlib.contextmanager
def paused(proc):
    """Every process of a node stopped (SIGSTOP) while the block runs: the run cannot finish meanwhile."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.suspend()
    try:
        yield
    finally:
        for p in tree:
            p.resume()


def _wait_up_again(recipe) -> None:
    """Until node 2's second start says its server answers (its first start's URL is still listed:
    a SIGKILLed node takes nothing out of the list)."""
    deadline = time.monotonic() + 300
    while _log(recipe, 2).count("servers up") < 2:
        assert time.monotonic() < deadline, _log(recipe, 2)[-3000:]
        time.sleep(0.1)


@pytest.mark.parametrize("router, weight_sync", [(True, "disk"), (False, "tensor"), (False, "distributed")])
def test_a_rollout_node_lost_mid_run_the_job_goes_on_and_takes_it_back(router, weight_sync, tmp_path,
                                                                        tiny_model_dir):
    if router and importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed")
    data = write_tiny_data(tmp_path / "data")
    broadcast = {"weight_sync_backend": "gloo", "weight_sync_port": free_port()} if weight_sync == "distributed" else {}
    rollout = _sglang(free_ports(2), nodes=2, servers=2, router=router, router_port=free_port(),
                      retry_on_other_servers=True, weight_sync=weight_sync, **broadcast)
    recipe = _recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 1}, rollout=rollout, steps=STEPS)
    run = tmp_path / "job" / "runs" / "rl"
    procs = start_nodes(recipe, 3, gpus_per_node=1, port=free_port())
    try:
        _wait_for_step(run, 2, procs, recipe)
        node_dies(procs[2])  # node 2: its cluster-node, rollout-servers and server, SIGKILL
        lost_after = len(_metrics(run))
        _wait_for_step(run, lost_after + 2, procs, recipe)  # two steps on node 1's server alone
        with paused(procs[0]):  # node 2 started again, up before the run goes on
            procs[2], = start_nodes(recipe, 3, gpus_per_node=1, port=free_port(), only=2)
            _wait_up_again(recipe)
        assert procs[0].wait(timeout=600) == 0, _log(recipe, 0)[-3000:]
    finally:
        stop(procs[1:], signal.SIGTERM)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and (run / "final").is_dir()
    live = [r["rollout_servers_live"] for r in rows]
    assert live[:2] == [2, 2]
    assert 1 in live[lost_after:lost_after + 2]  # left out once a request or a push failed on it
    assert live[-1] == 2  # taken back at a later push
    trainer_log = " ".join(_log(recipe, 0).split())  # lines wrapped at the console's width
    assert "left out until it answers again" in trainer_log and "answers again: taken back" in trainer_log
    # the router was told: node 2's server taken off its list, put back on by the push that took it back
    if router:
        lost = f"http://{host(2)}:{rollout['sglang']['base_port'] + 1}"
        router_log = ANSI.sub("", (run / "sglang_router.log").read_text(errors="replace"))
        assert "method=POST uri=/workers " in router_log[router_log.index(f"Removed worker {lost}"):]
    served = (run / "rollout_node1" / "sglang_server_1.log").read_text()
    assert f"weight_version={STEPS}" in served  # and it served the run's last weights
