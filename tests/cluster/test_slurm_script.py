"""`rlrecipe slurm`: the batch script for a recipe's layout (rlrecipe/cluster/sbatch.py, layout.py), its
host list read as Slurm writes it, and its refusals."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rlrecipe.cluster.layout import BOTH, ROLLOUT, TRAIN, job_layout
from rlrecipe.cluster.nodelist import expand_nodelist
from rlrecipe.cluster.sbatch import SlurmOptions, render
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import load_recipe, recipe_from_dict


@pytest.mark.parametrize("text, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[08-10,12],login2", ["gpu08", "gpu09", "gpu10", "gpu12", "login2"]),
    ("a[1-2]b[0-1]", ["a1b0", "a1b1", "a2b0", "a2b1"]),
    ("node[7]", ["node7"]),
])
def test_host_lists_expand_as_scontrol_show_hostnames(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-03", "gpu01]", "gpu[a-b]", ""])
def test_a_malformed_host_list_is_one_clear_error(text):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(text)


def _sruns(script: str) -> list[dict]:
    out = []
    for line in script.splitlines():
        line = line.strip()
        if line.startswith("srun "):
            head = line.split(" ${RLRECIPE")[0]
            flags = dict(re.findall(r"--([a-z-]+)=(\S+)", head))
            assert " --whole " in head  # each step its nodes whole, whatever a task's default share
            out.append({**flags, "background": line.endswith("&")})
    return out


def test_the_published_7b_layout_is_sixteen_nodes_in_two_roles():
    loaded = load_recipe("recipes/7b_boba.yaml")
    recipe = loaded.recipe
    script = render(loaded, [], SlurmOptions(gpus_per_node=8, assume_shared=True))
    assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
    rollout, train = _sruns(script)
    # the rollout nodes come after the training nodes, in the background; the job's status is training's
    assert rollout == {"nodes": str(recipe.rollout.sglang.nodes), "ntasks": "8", "relative": str(recipe.trainer.nodes),
                       "kill-on-bad-exit": "0", "ntasks-per-node": "1", "job-name": "rollout-servers",
                       "background": True}
    assert train == {"nodes": str(recipe.trainer.nodes), "ntasks": "8", "relative": "0", "kill-on-bad-exit": "1",
                     "ntasks-per-node": "1", "background": False}
    assert script.rstrip().endswith("exit $rc") and 'stop_step rollout-servers "$servers"' in script
    assert "#SBATCH --requeue" in script and "python" not in script  # bash alone on the batch host
    assert "cluster-node recipes/7b_boba.yaml --stage rl --gpus-per-node 8" in script
    layout = job_layout(recipe, 8)
    assert [layout.role(n) for n in (0, 7, 8, 15)] == [TRAIN, TRAIN, ROLLOUT, ROLLOUT]
    # bash reads it
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_fit_then_slurm_gives_the_fitted_layout(tmp_path):
    """The one-node colocated 7B recipe fitted to 2 nodes of 8 x 80 GB: the job is the 2 nodes fit laid
    out, with the roles fit chose (a training node and a rollout node, or both on each)."""
    fitted = tmp_path / "fitted.yaml"
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "fit", "recipes/7b_boba_8x80gb.yaml", "--gpus", "8",
                    "--gpu-memory", "80", "--nodes", "2", "--out", str(fitted)], check=True, capture_output=True)
    loaded = load_recipe(fitted)
    recipe = loaded.recipe
    layout = job_layout(recipe, 8)
    script = render(loaded, [], SlurmOptions(gpus_per_node=8, assume_shared=True))
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    assert nodes == layout.nodes == 2
    if recipe.rollout.colocate:
        assert recipe.trainer.nodes == 2 and [layout.role(n) for n in range(nodes)] == [BOTH, BOTH]
        (only,) = _sruns(script)
        assert only["nodes"] == "2" and not only["background"]
    else:  # fit's split: "1 + 1 nodes for training + rollout"
        assert (recipe.trainer.nodes, recipe.rollout.sglang.nodes) == (1, 1)
        assert [layout.role(n) for n in range(nodes)] == [TRAIN, ROLLOUT]
        rollout, train = _sruns(script)
        assert (rollout["relative"], train["relative"], rollout["background"]) == ("1", "0", True)
    assert recipe.trainer.nproc <= 8


def _spec(**over) -> dict:
    spec = {"run": {"name": "r"}, "model": {"tiny": {}}, "rl": {}, "trainer": {"engine": "deepspeed", "nproc": 4,
                                                                              "nodes": 2},
            "rollout": {"engine": "sglang", "sglang": {"num_servers": 8, "nodes": 2}}}
    for key, value in over.items():
        section, field = key.split("__")
        spec[section] = {**spec[section], field: value}
    return spec


def test_refusals_name_what_does_not_fit(tmp_path):
    def loaded(spec):
        from rlrecipe.recipe.schema import LoadedRecipe

        return LoadedRecipe(recipe=recipe_from_dict(spec), path="r.yaml")

    with pytest.raises(UserError, match=r"the layout needs 4 nodes .* but --nodes is 3"):
        render(loaded(_spec()), [], SlurmOptions(gpus_per_node=8, nodes=3, assume_shared=True))
    with pytest.raises(UserError, match="trainer.nproc 4 ranks a node, but --gpus-per-node is 2"):
        job_layout(recipe_from_dict(_spec()), 2)
    with pytest.raises(UserError, match=r"run.output_dir .* lies on a local \w+ filesystem"):
        render(loaded(_spec(run__output_dir=str(tmp_path))), [], SlurmOptions(gpus_per_node=8))
    # one node whose GPUs hold the trainer and every server: the run launches them itself
    one = job_layout(recipe_from_dict(_spec(trainer__nodes=1, trainer__nproc=2,
                                            rollout__sglang={"num_servers": 2, "nodes": 1})), 8)
    assert (one.nodes, one.serves) == (1, False)
    # SFT needs no rollout nodes
    assert job_layout(recipe_from_dict(_spec()), 8, serving=False).nodes == 2


def test_the_cli_writes_an_executable_script(tmp_path):
    out = tmp_path / "job.sbatch"
    done = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "slurm", "recipes/7b_boba.yaml", "--out", str(out),
                           "--assume-shared", "--partition", "gpu", "--time", "48:00:00"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --time=48:00:00" in text and out.stat().st_mode & 0o111


def _docs_scripts() -> list[str]:
    from pathlib import Path

    text = Path("docs/cluster.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) if block.startswith("#!/bin/bash")]


def test_the_scripts_shown_in_the_docs_are_what_slurm_writes_now():
    published, colocated = _docs_scripts()
    seven_b = render(load_recipe("recipes/7b_boba.yaml"), [],
                     SlurmOptions(gpus_per_node=8, nodes=16, assume_shared=True))
    one_node = render(load_recipe("recipes/7b_boba_8x80gb.yaml"), [], SlurmOptions(gpus_per_node=8))
    assert published == seven_b.strip() and colocated == one_node.strip()
