"""`rlrecipe cluster-node` on its own: where a node stands in the job, read from the variables a real
Slurm step has, and the training node's bounded wait for a rollout node that never comes up (a
1-second start timeout, which a real job would not be written with)."""

from __future__ import annotations

import time

import pytest

from rlrecipe.cluster import node as node_module
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import load_recipe
from tests.cluster.jobs import job_recipe, sglang_servers
from tests.helpers import write_tiny_data
from tests.ports import free_ports


def test_a_node_is_placed_by_its_name_in_the_job_not_by_its_step_node_id():
    # a rollout step started with --relative=1 numbers its one node 0, as Slurm does
    env = {"SLURMD_NODENAME": "gpu02", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]",
           node_module.PORT_ENV: "20123"}
    place = node_module.place_from_env(env, 29500)
    assert (place.node, place.head, place.port) == (1, "gpu01", 20123)
    with pytest.raises(UserError, match=r"SLURMD_NODENAME='login1' is not among the job's hosts"):
        node_module.place_from_env({**env, "SLURMD_NODENAME": "login1"}, 29500)
    with pytest.raises(UserError, match="SLURMD_NODENAME is not set"):
        node_module.place_from_env({"SLURM_JOB_NODELIST": "gpu01"}, 29500)


def test_servers_bound_to_loopback_bind_to_the_node_name_instead(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    recipe = load_recipe(job_recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 1},
                                    rollout=sglang_servers(free_ports(1), nodes=1, servers=1)))
    layout = node_module.job_layout(recipe.recipe, 1)
    place = node_module.Place(1, ["gpu01", "gpu02"], 20000)
    cmd = node_module.rollout_command(recipe, [], layout, place)
    assert cmd[cmd.index("--url-host") + 1] == "gpu02" and "rollout.sglang.host=gpu02" in cmd
    wide = load_recipe(recipe.path, ["rollout.sglang.host=0.0.0.0"])  # bound to every address: kept
    assert not any(x.startswith("rollout.sglang.host=gpu") for x in node_module.rollout_command(wide, [], layout,
                                                                                                 place))


@pytest.mark.slow
def test_a_rollout_node_that_never_comes_up_stops_the_training_node_in_one_line(tmp_path, tiny_model_dir,
                                                                              monkeypatch):
    data = write_tiny_data(tmp_path / "data")
    recipe = job_recipe(tmp_path / "job", data, tiny_model_dir, trainer={"nproc": 2},
                        rollout=sglang_servers(free_ports(1), nodes=1, servers=1, startup_timeout_s=1))
    monkeypatch.setattr(node_module, "URLS_GRACE_S", 1.0)
    env = {"SLURMD_NODENAME": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.[1-2]", node_module.PORT_ENV: "29999"}
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        node_module.run_node(load_recipe(recipe), [], stage="rl", gpus_per_node=2, resume=False, env=env)
    assert time.monotonic() - t0 < 30
    assert "rollout_urls.yaml: 0 of 1 rollout servers listed after 2s" in str(err.value)
    assert "\n" not in str(err.value)
