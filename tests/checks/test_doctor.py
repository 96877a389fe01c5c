"""`rlrecipe doctor` on this (CPU) machine, and the checks `rlrecipe sft` / `rlrecipe rl` refuse on at start."""

import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from rlrecipe.checks import doctor, host_checks
from rlrecipe.checks.preflight import check_stage_inputs
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe, load_recipe, recipe_from_dict
from tests.helpers import write_tiny_data

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
STATUSES = {doctor.OK, doctor.FAIL, doctor.UNKNOWN}


def loaded(sections: dict, tmp_path: Path) -> LoadedRecipe:
    sections = {"run": {"name": "t", "output_dir": str(tmp_path / "runs")}, **sections}
    return LoadedRecipe(recipe=recipe_from_dict(sections), path=str(tmp_path / "r.yaml"))


def tiny_rl(tmp_path: Path, **model) -> dict:
    data = tmp_path / "data"
    if not (data / "rl.jsonl").exists():
        write_tiny_data(data, n=8)
    return {"model": {"tiny": {}, **model}, "data": {"train": str(data / "rl.jsonl")},
            "rl": {"steps": 1}, "rollout": {"max_new_tokens": 64}}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_gets_a_full_table_on_cpu(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = doctor.run_checks(load_recipe(path), hub_timeout_s=1)
    names = [c.name for c in rows]
    assert {"torch", "CUDA (torch build)", "GPUs", "attention", "model", "output directory"} <= set(names)
    assert all(c.status in STATUSES and c.need and c.have for c in rows)
    recipe = load_recipe(path).recipe
    attention = rows[names.index("attention")]
    if recipe.model.attn_implementation == "flash_attention_2" and not doctor.flash_attn_state()[0]:
        assert attention.status == doctor.FAIL and attention.fatal and "flash-attn not installed" in attention.have
    elif recipe.model.attn_implementation != "flash_attention_2":
        assert attention.status == doctor.OK
    if doctor.needs_cuda(recipe) and not __import__("torch").cuda.is_available():
        assert rows[names.index("GPUs")].status == doctor.UNKNOWN  # said, not failed, on a machine without GPUs


def test_disk_need_counts_two_kept_checkpoints_and_one_being_written():
    from rlrecipe.checks.host_disk import footprint
    from rlrecipe.checks.model_dims import BYTES, model_dims

    ld = load_recipe(REPO / "recipes/7b_boba.yaml")
    d, r = model_dims(ld), ld.recipe
    outside = footprint(r, d)
    one = sum(outside.checkpoint.values())
    assert one == pytest.approx((12 + 2) * d.params())  # DeepSpeed: fp32 master + m + v; fp16 HF export
    parts = outside.disk
    assert sum(parts.values()) == pytest.approx(3 * one + 2 * BYTES["float16"] * d.params())
    assert 0.3e12 < sum(parts.values()) < 0.45e12  # the "about 0.4 TB at 7B"


def test_host_memory_of_the_c3po_recipe_on_rank_0():
    from rlrecipe.checks.host_disk import footprint
    from rlrecipe.checks.model_dims import GIB, model_dims

    ld = load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml")
    total = sum(footprint(ld.recipe, model_dims(ld)).host.values()) / GIB
    assert 45 <= total <= 65


def test_flash_attention_that_cannot_load_stops_the_stage_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "flash_attn_state", lambda: (False, "flash-attn not installed"))
    ld = loaded(tiny_rl(tmp_path, attn_implementation="flash_attention_2"), tmp_path)
    with pytest.raises(UserError) as err:
        check_stage_inputs(ld, "rl")
    lines = str(err.value).splitlines()
    assert "rlrecipe doctor" in lines[0]
    assert len(lines) == 2 and lines[1].strip().startswith("attention: needs flash_attention_2")
    assert "flash-attn not installed" in lines[1] and "model.attn_implementation=sdpa" in lines[1]
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made
    monkeypatch.setattr(doctor, "flash_attn_state", lambda: (True, "flash-attn 2.8.3"))
    check_stage_inputs(ld, "rl")  # loadable: no refusal
    check_stage_inputs(loaded(tiny_rl(tmp_path), tmp_path), "rl")  # sdpa needs torch only


def test_a_disk_too_small_for_the_checkpoints_stops_the_stage(tmp_path, monkeypatch):
    ld = loaded(tiny_rl(tmp_path), tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(host_checks.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(UserError) as err:
        check_stage_inputs(ld, "rl")
    [line] = [x for x in str(err.value).splitlines() if "disk for run.dir" in x]
    assert "checkpoints (2 kept + 1 being written)" in line and "0.0 GB free" in line
    monkeypatch.setattr(host_checks.shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    check_stage_inputs(ld, "rl")


def test_an_output_directory_that_cannot_be_written_stops_the_stage(tmp_path):
    (tmp_path / "afile").write_text("x")  # run.output_dir under a file: nothing can be made there
    ld = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "t", "output_dir": str(tmp_path / "afile" / "runs")},
                                               **tiny_rl(tmp_path)}), path="r.yaml")
    with pytest.raises(UserError) as err:
        check_stage_inputs(ld, "rl")
    [line] = [x for x in str(err.value).splitlines() if "output directory" in x]
    assert str(tmp_path / "afile") in line


def test_disk_weight_sync_with_remote_servers_needs_a_shared_absolute_output_dir(tmp_path, monkeypatch):
    ro = {"engine": "sglang", "max_new_tokens": 64, "urls": ["http://10.255.0.7:30000"]}
    rel = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "t"}, **tiny_rl(tmp_path), "rollout": ro}), path="r.yaml")
    check = host_checks.check_shared_export(rel.recipe)
    assert check.status == doctor.FAIL and check.fatal and "relative run.output_dir 'runs'" in check.have
    with pytest.raises(UserError, match="export seen by servers"):
        check_stage_inputs(rel, "rl")
    # absolute, on a local filesystem: said, but not a refusal (the path may be mounted elsewhere too)
    monkeypatch.setattr(host_checks, "filesystem_type", lambda p: "ext4")
    local = host_checks.check_shared_export(loaded({**tiny_rl(tmp_path), "rollout": ro}, tmp_path).recipe)
    assert local.status == doctor.FAIL and not local.fatal and "local ext4" in local.have
    monkeypatch.setattr(host_checks, "filesystem_type", lambda p: "nfs4")
    assert host_checks.check_shared_export(loaded({**tiny_rl(tmp_path), "rollout": ro}, tmp_path).recipe).status == doctor.OK
    # servers on this machine, or weights broadcast: nothing to check
    own = {"engine": "sglang", "urls": ["http://127.0.0.1:30000", "http://localhost:30001"]}
    assert host_checks.check_shared_export(loaded({**tiny_rl(tmp_path), "rollout": own}, tmp_path).recipe) is None
    dist = {**ro, "sglang": {"weight_sync": "distributed"}}
    assert host_checks.check_shared_export(loaded({**tiny_rl(tmp_path), "rollout": dist}, tmp_path).recipe) is None


def test_filesystem_type_of_a_path_comes_from_the_longest_mount_point():
    kind = host_checks.filesystem_type(Path("/proc/self"))
    assert kind == "proc"


def test_doctor_command_prints_the_table_and_exits_by_its_verdict(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "doctor", "recipes/tiny_sft.yaml", "--set",
                          f"run.output_dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("check", "need", "have", "status", "torch", "attention", "disk for run.dir", "output directory"):
        assert word in out.stderr
    bad = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "doctor", "recipes/tiny_sft.yaml", "--set",
                          "model.attn_implementation=flash_attention_2", "--set", f"run.output_dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    if not doctor.flash_attn_state()[0]:
        assert bad.returncode == 1 and "check(s) failed: attention" in bad.stderr


@pytest.mark.parametrize(("installed", "status"), [("0.3.2", doctor.OK), ("0.2.4", doctor.FAIL), (None, doctor.FAIL)])
def test_the_router_needs_sglang_router_0_3_for_its_workers_api(installed, status, monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda dist: installed if dist == "sglang-router" else "0.5.23")
    recipe = recipe_from_dict({"run": {"name": "t"}, "model": {"path": "m"},
                               "rollout": {"engine": "sglang", "sglang": {"router": True}}})
    row = next(c for c in doctor.check_sglang(recipe) if c.name == "sglang-router")
    assert row.status == status and row.need == "sglang-router >= 0.3"
