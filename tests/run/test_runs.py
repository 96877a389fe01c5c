"""Run directories: names, the lock, what a fresh start may delete, and resuming from damaged checkpoints."""

import json
import os
import signal
import subprocess
import sys

import pytest
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.run.lock import RunDirBusy
from rlrecipe.run.manifest import check_manifest
from rlrecipe.run.metrics_file import read_metrics
from rlrecipe.run.record import Run
from rlrecipe.stages.lifecycle import start_stage
from tests.helpers import write_recipe, write_tiny_data


def loaded(tmp_path, name="r", **sections):
    recipe = recipe_from_dict({"run": {"name": name, "output_dir": str(tmp_path / "runs"), "keep_checkpoints": 5},
                               "model": {"tiny": {}}, **sections})
    return LoadedRecipe(recipe=recipe, path="r.yaml")


def checkpoint(run: Run, step: int, payload: bytes = b"weights") -> None:
    with run.writing_checkpoint(step) as d:
        (d / "model").mkdir()
        (d / "model" / "model.safetensors").write_bytes(payload * 100)
        (d / "progress.json").write_text(json.dumps({"step": step}))


def steps(run_dir):
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")]


# -- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../victim", "", " ", "a/b", ".", "..", "a\\b", "/abs"])
def test_run_name_must_be_one_path_component(tmp_path, name):
    with pytest.raises(RecipeError, match="run.name: .*one non-empty directory name"):
        loaded(tmp_path, name=name)


def test_validate_refuses_a_name_that_climbs_out(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", {"run": {"name": "ok"}, "model": {"tiny": {}}})
    result = CliRunner().invoke(app, ["validate", str(path), "--set", "run.name=../victim"])
    assert result.exit_code == 2 and "run.name" in result.output
    assert CliRunner().invoke(app, ["validate", str(path), "--set", "run.name=v2.1_x"]).exit_code == 0


# -- the lock ---------------------------------------------------------------------------------------
def test_a_second_run_in_the_same_directory_is_refused_while_the_first_lives(tmp_path):
    first = Run(loaded(tmp_path), "sft")
    with pytest.raises(RunDirBusy, match=f"in use by pid {os.getpid()} "):
        Run(loaded(tmp_path), "sft")
    first.log(1, {"loss": 1.0}, echo=False)
    first.finish()  # lets go
    Run(loaded(tmp_path), "sft").finish()


def test_the_stale_lock_of_a_killed_process_is_taken_over_and_said(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    code = ("import os, signal, sys; from rlrecipe.run.lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print(os.getpid(), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    dead_pid = int(proc.stdout)
    Run(loaded(tmp_path), "sft").finish()
    err = capsys.readouterr().err
    assert f"taking over the stale lock of pid {dead_pid}" in err


# -- what a fresh start may delete ------------------------------------------------------------------
def test_a_run_of_another_stage_is_kept_unless_overwrite(tmp_path):
    sft = Run(loaded(tmp_path), "sft")
    checkpoint(sft, 2)
    sft.log(1, {"loss": 1.0}, echo=False)
    (sft.final_model_dir).mkdir()
    (sft.final_model_dir / "config.json").write_text("{}")
    sft.finish()
    before = sorted(p.relative_to(sft.dir) for p in sft.dir.rglob("*"))
    with pytest.raises(UserError, match="holds an earlier 'sft' run; --overwrite"):
        Run(loaded(tmp_path), "rl")
    with pytest.raises(UserError, match="holds an earlier 'sft' run"):
        Run(loaded(tmp_path), "rl", resume=True)
    assert sorted(p.relative_to(sft.dir) for p in sft.dir.rglob("*")) == before  # nothing touched
    rl = Run(loaded(tmp_path), "rl", overwrite=True)
    assert not list(rl.ckpt_dir.iterdir()) and not rl.metrics_path.exists() and not rl.final_model_dir.exists()
    assert json.loads((rl.dir / "env.json").read_text())["stage"] == "rl"


def test_checkpoints_or_a_final_model_of_the_same_stage_are_kept_unless_overwrite(tmp_path):
    run = Run(loaded(tmp_path), "sft")
    checkpoint(run, 2)
    run.finish()
    with pytest.raises(UserError, match=r"holds checkpoints \(up to step_0000002\).*--resume.*--overwrite"):
        Run(loaded(tmp_path), "sft")
    assert (run.ckpt_dir / "step_0000002" / "progress.json").exists()
    # checkpoints deleted by hand to save space, the final model kept: still earlier work
    import shutil

    shutil.rmtree(run.ckpt_dir)
    (run.final_model_dir).mkdir()
    (run.final_model_dir / "config.json").write_text("{}")
    with pytest.raises(UserError, match="holds a final model"):
        Run(loaded(tmp_path), "sft")
    with pytest.raises(UserError, match="exclude each other"):
        Run(loaded(tmp_path), "sft", resume=True, overwrite=True)


def test_a_run_killed_before_its_first_checkpoint_starts_over_with_empty_metrics(tmp_path):
    run = Run(loaded(tmp_path), "sft")
    run.log(1, {"loss": 1.0}, echo=False)
    run.release()  # as if killed: metrics, no checkpoint
    again = Run(loaded(tmp_path), "sft")
    assert steps(again.dir) == []
    again.log(1, {"loss": 2.0}, echo=False)
    assert steps(again.dir) == [1]


def test_the_output_dir_must_be_a_writable_directory(tmp_path):
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(UserError, match="run.output_dir: cannot write run records in .*runs/r"):
        Run(loaded(tmp_path), "sft")


# -- model and data are checked before anything is deleted -----------------------------------------
@pytest.fixture
def earlier_sft_run(tmp_path):
    data = write_tiny_data(tmp_path / "data", n=8)
    run = Run(loaded(tmp_path), "sft")
    checkpoint(run, 2)
    run.finish()
    return data, run.ckpt_dir / "step_0000002"


def test_a_missing_model_fails_before_overwrite_deletes_anything(tmp_path, earlier_sft_run):
    data, ckpt = earlier_sft_run
    bad = loaded(tmp_path, model={"path": str(tmp_path / "nowhere")}, data={"train": str(data / "sft.jsonl")})
    with pytest.raises(RecipeError, match="model.path: no model directory at .*nowhere"):
        start_stage(bad, "sft", resume=False, overwrite=True)
    assert ckpt.is_dir()


def test_a_broken_config_json_fails_before_overwrite_deletes_anything(tmp_path, earlier_sft_run):
    data, ckpt = earlier_sft_run
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", ')
    bad = loaded(tmp_path, model={"path": str(model)}, data={"train": str(data / "sft.jsonl")})
    with pytest.raises(RecipeError, match="config.json: not valid JSON"):
        start_stage(bad, "sft", resume=False, overwrite=True)
    assert ckpt.is_dir()


def test_missing_or_empty_data_fails_before_overwrite_deletes_anything(tmp_path, earlier_sft_run):
    data, ckpt = earlier_sft_run
    with pytest.raises(UserError, match="nothing.jsonl: file not found"):
        start_stage(loaded(tmp_path, data={"train": str(tmp_path / "nothing.jsonl")}), "sft", resume=False,
                    overwrite=True)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl: no rows; the rl stage needs at least one"):
        start_stage(loaded(tmp_path, data={"train": str(tmp_path / "empty.jsonl")}, rollout={"max_new_tokens": 40}),
                    "rl", resume=False, overwrite=True)
    assert ckpt.is_dir()


def test_a_model_inside_the_run_being_replaced_is_refused(tmp_path, earlier_sft_run):
    data, ckpt = earlier_sft_run
    own = loaded(tmp_path, run={"name": "r", "output_dir": str(tmp_path / "runs"), "init_from": "run:r"},
                 data={"train": str(data / "rl.jsonl")})
    with pytest.raises(RecipeError, match="run.init_from: .* lies inside this run's own directory"):
        start_stage(own, "rl", resume=False, overwrite=True)
    assert ckpt.is_dir()


def test_generation_longer_than_the_context_is_refused(tmp_path):
    data = write_tiny_data(tmp_path / "data", n=8)
    rec = loaded(tmp_path, model={"tiny": {"max_position_embeddings": 64}}, rollout={"max_new_tokens": 64},
                 data={"train": str(data / "rl.jsonl")})
    with pytest.raises(RecipeError, match="rollout.max_new_tokens: 64 leaves no room .* context of 64 tokens"):
        start_stage(rec, "rl", resume=False, overwrite=False)


# -- resuming from damaged state --------------------------------------------------------------------
def _two_checkpoints_and_metrics(tmp_path) -> Run:
    run = Run(loaded(tmp_path), "sft")
    for step in range(1, 6):
        run.log(step, {"loss": 1.0 / step}, echo=False)
        if step in (2, 4):
            checkpoint(run, step, payload=bytes([step]))
    with run.metrics_path.open("a") as f:
        f.write('{"step": 6, "stage": "sf')  # a kill in the middle of a line
    run.release()
    return run


def _garble(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "directory missing, latest names it": lambda d: __import__("shutil").rmtree(d),
    "truncated weights": lambda d: (d / "model" / "model.safetensors").write_bytes(b"\x04" * 10),
    "same size, other bytes": lambda d: _garble(d / "model" / "model.safetensors"),
    "garbage progress file": lambda d: (d / "progress.json").write_text('{"step": 4'),
    "missing progress file": lambda d: (d / "progress.json").unlink(),
    "no manifest (write never finished)": lambda d: (d / "manifest.json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path, capsys, damage):
    run = _two_checkpoints_and_metrics(tmp_path)
    newest = run.ckpt_dir / "step_0000004"
    assert check_manifest(newest) is None and (run.ckpt_dir / "latest").read_text() == "step_0000004"
    DAMAGE[damage](newest)
    resumed = Run(loaded(tmp_path), "sft", resume=True)
    assert resumed.latest_checkpoint() == run.ckpt_dir / "step_0000002"
    assert steps(resumed.dir) == [1, 2]  # cut back to the checkpoint, the partial line gone
    assert "resuming from step_0000002, the newest complete checkpoint" in capsys.readouterr().err


def test_resume_with_no_complete_checkpoint_is_refused(tmp_path):
    run = _two_checkpoints_and_metrics(tmp_path)
    for step in (2, 4):
        (run.ckpt_dir / f"step_{step:07d}" / "progress.json").unlink()
    with pytest.raises(UserError, match="none of the 2 checkpoints is complete; --overwrite"):
        Run(loaded(tmp_path), "sft", resume=True)
    assert steps(run.dir) == [1, 2, 3, 4, 5]  # nothing cut on a refusal


def test_resume_before_any_checkpoint_starts_at_step_0_with_no_metrics(tmp_path):
    run = Run(loaded(tmp_path), "sft")
    run.log(1, {"loss": 1.0}, echo=False)  # killed after logging step 1, before its checkpoint
    run.release()
    resumed = Run(loaded(tmp_path), "sft", resume=True)
    assert resumed.latest_checkpoint() is None and steps(resumed.dir) == []


def test_a_partial_last_metrics_line_is_skipped(tmp_path):
    run = Run(loaded(tmp_path), "sft")
    run.log(1, {"tokens": 5}, echo=False)
    with run.metrics_path.open("a") as f:
        f.write('{"step": 2, "tok')
    assert steps(run.dir) == [1]
    run.finish(token_columns=("tokens",))
    assert json.loads((run.dir / "run_summary.json").read_text())["tokens_total"] == 5


def test_the_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib

    run = Run(loaded(tmp_path), "sft")
    checkpoint(run, 3, payload=b"ab")
    ckpt = run.ckpt_dir / "step_0000003"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert set(files) == {"model/model.safetensors", "progress.json"}
    assert files["model/model.safetensors"] == {"size": 200, "sha256": hashlib.sha256(b"ab" * 100).hexdigest()}


def test_run_records_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recipe = recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path), "tracking": {"wandb": True}},
                               "model": {"tiny": {}}})
    run = Run(LoadedRecipe(recipe=recipe, path="r.yaml"), "sft")
    run.log(1, {"loss": 1.5, "tokens": 10}, echo=False)
    run.log(2, {"loss": 1.0, "tokens": 7}, echo=False)
    run.finish(token_columns=("tokens",))
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    assert env["recipe_sha256"] == recipe.sha256() and env["seed"] == 1 and "commit" in env and "dirty" in env
    # what is trained, not where: the same for the recipe fitted to other GPUs
    assert env["algorithm_sha256"] == recipe.algorithm_sha256() != recipe.sha256()
    assert env["packages"]["torch"] and env["python"]
    import torch

    cpu = env["cpu"]  # what decides the CPU kernels, hence the numbers across machines
    assert cpu["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu["torch_threads"] == torch.get_num_threads() and isinstance(cpu["flags"], list)
    assert cpu["model"]
    assert (tmp_path / "r" / "recipe.sha256").read_text().split()[0] == recipe.sha256()
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 1.5
    cost = json.loads((tmp_path / "r" / "run_summary.json").read_text())
    assert cost["tokens_total"] == 17 and cost["gpus"] == 0 and cost["gpu_hours_this_session"] == 0
    assert list((tmp_path / "r").rglob("offline-run-*")), "W&B wrote an offline run"


# -- resuming under a newer schema ------------------------------------------------------------------
def _as_if_started_by_older_code(run: Run, edit) -> None:
    """Rewrite the run's recorded recipe as an older rlrecipe would have written it (`edit` changes
    the resolved recipe dict in place), with that recipe's sha256."""
    import hashlib

    import yaml

    recorded = yaml.safe_load((run.dir / "recipe.yaml").read_text())
    edit(recorded)
    (run.dir / "recipe.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    digest = hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()
    (run.dir / "recipe.sha256").write_text(f"{digest}  r.yaml\n")


def test_a_run_resumes_under_fields_the_schema_gained_at_their_defaults(tmp_path, capsys):
    run = _two_checkpoints_and_metrics(tmp_path)
    _as_if_started_by_older_code(run, lambda r: (r["rollout"]["sglang"].pop("max_restarts"),
                                                 r["trainer"].pop("logprob_chunk_tokens")))
    assert (run.dir / "recipe.sha256").read_text().split()[0] != loaded(tmp_path).sha256
    resumed = Run(loaded(tmp_path), "sft", resume=True)
    assert resumed.latest_checkpoint() == run.ckpt_dir / "step_0000004" and steps(resumed.dir) == [1, 2, 3, 4]
    said = " ".join(capsys.readouterr().err.split())
    assert ("resuming with 2 field(s) added to the recipe schema since it started, at their defaults: "
            "rollout.sglang.max_restarts, trainer.logprob_chunk_tokens") in said
    assert (run.dir / "recipe.sha256").read_text().split()[0] == loaded(tmp_path).sha256  # the run goes on under it


def test_a_resume_that_changes_the_experiment_is_refused_naming_the_fields(tmp_path):
    run = _two_checkpoints_and_metrics(tmp_path)
    _as_if_started_by_older_code(run, lambda r: (r["trainer"].update(lr=3e-4), r["trainer"].pop("adam_eps"),
                                                 r["rollout"]["sglang"].pop("max_restarts")))
    retry = {"sglang": {"retry_on_other_servers": True, "max_restarts": 2}}
    with pytest.raises(RecipeError) as err:
        Run(loaded(tmp_path, rollout=retry), "sft", resume=True)
    msg = str(err.value)
    assert msg.startswith(f"r.yaml: recipe differs from the one {run.dir} was started with (")
    assert "trainer.lr: 0.0003 -> 1e-05" in msg  # a value changed
    assert "rollout.sglang.retry_on_other_servers: False -> True" in msg
    assert "rollout.sglang.max_restarts: new, set to 2" in msg  # a new field, not at its default
    assert "adam_eps" not in msg  # a new field at its default is no difference
    assert steps(run.dir) == [1, 2, 3, 4, 5]  # nothing cut on a refusal
