"""The OpenMP wait policy set before torch loads, and the thread count a run records and checks on resume."""

import json
import os
import subprocess
import sys

import torch

from rlrecipe.core.threads import thread_change, thread_record
from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.run.record import Run

PROBE = ("import os, rlrecipe, torch; "
         "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads())")
UNSET = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _probe(env: dict, code: str = PROBE) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in UNSET}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.split()


def test_importing_the_package_first_gives_openmp_a_short_spin():
    assert _probe({"OMP_NUM_THREADS": "2"}) == ["1000", "None", "2"]


def test_a_wait_setting_the_user_made_is_kept_and_nothing_added():
    assert _probe({"OMP_WAIT_POLICY": "active"})[:2] == ["None", "active"]
    assert _probe({"GOMP_SPINCOUNT": "5"})[:2] == ["5", "None"]


def test_torch_imported_first_is_recorded_as_the_runtime_default():
    code = "import torch, rlrecipe; from rlrecipe.core.threads import thread_record; print(thread_record()['wait_policy'])"
    assert _probe({}, code) == ["None"]
    code = "import rlrecipe; from rlrecipe.core.threads import thread_record; print(thread_record()['wait_policy'])"
    assert _probe({}, code) == ["GOMP_SPINCOUNT=1000"]


def test_thread_change_names_both_counts_only_when_they_differ():
    assert thread_change({"torch_threads": 2}, {"torch_threads": 2}) is None
    assert thread_change(None, {"torch_threads": 2}) is None
    assert thread_change({}, {"torch_threads": 2}) is None
    msg = thread_change({"torch_threads": 2}, {"torch_threads": 1})
    assert "started with 2" in msg and "resumes with 1" in msg and "OMP_NUM_THREADS=2" in msg


def test_resume_with_another_thread_count_says_so_and_records_the_new_one(tmp_path, capsys):
    recipe = recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "model": {"tiny": {}}})
    loaded = LoadedRecipe(recipe=recipe, path="r.yaml")
    run = Run(loaded, "sft")
    run.log(1, {"loss": 1.0}, echo=False)
    run.finish()
    recorded = json.loads((tmp_path / "r" / "env.json").read_text())["cpu"]
    assert recorded["torch_threads"] == torch.get_num_threads()
    assert recorded["wait_policy"] == thread_record()["wait_policy"]

    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        capsys.readouterr()
        again = Run(loaded, "sft", resume=True)
        again.finish()
    finally:
        torch.set_num_threads(before)
    out = " ".join(capsys.readouterr().err.split())
    assert f"started with {before} intra-op thread(s) and resumes with {before + 1}" in out
    assert json.loads((tmp_path / "r" / "env.json").read_text())["cpu"]["torch_threads"] == before + 1
