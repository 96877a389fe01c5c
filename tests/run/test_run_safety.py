"""Nothing lost, nothing silently wrong: --overwrite keeps a finished run until the new one has a
checkpoint, a checkpoint knows its run, SFT does not export NaN weights."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from rlrecipe.cli.app import app
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
from rlrecipe.run.checkpoints import ADOPT_ENV
from rlrecipe.run.manifest import write_manifest
from rlrecipe.run.record import Run
from tests.chain.test_bad_input_matrix import BROKEN_MODELS
from tests.helpers import TINY_MODEL, write_tiny_data


def tree(root: Path) -> dict[str, str]:
    """Every file under root with its sha256 (the run's lock file, recreated by any start, left out)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def sft_recipe(tmp: Path, data: Path, **sections) -> dict:
    base = {"run": {"name": "r", "output_dir": str(tmp / "runs"), "seed": 3},
            "model": {"tiny": dict(TINY_MODEL)},
            "data": {"train": str(data / "sft.jsonl"), "prompt_template": "plain"},
            "sft": {"batch_size": 2, "max_steps": 2, "save_every": 1, "max_length": 128},
            "trainer": {"lr": 1e-3}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A real finished SFT run (two steps, two checkpoints, final/, metrics, summary)."""
    root = tmp_path_factory.mktemp("finished")
    data = write_tiny_data(root / "data", n=8)
    rec = write(root / "r.yaml", sft_recipe(root, data))
    result = CliRunner().invoke(app, ["sft", str(rec)])
    assert result.exit_code == 0, result.output
    run = root / "runs" / "r"
    assert (run / "final" / "model.safetensors").is_file() and (run / "checkpoints" / "step_0000002").is_dir()
    return root, data


@pytest.fixture
def old_run(finished, tmp_path):
    root, data = finished
    shutil.copytree(root / "runs", tmp_path / "runs")
    run = tmp_path / "runs" / "r"
    # the copy is this directory's run: its recorded recipe names where it now lies
    recipe = recipe_from_dict(sft_recipe(tmp_path, data))
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    (run / "recipe.sha256").write_text(f"{recipe.sha256()}  r.yaml\n")
    return run, data


@pytest.fixture(scope="module")
def broken(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for kind, (damage, _) in BROKEN_MODELS.items():
        out[kind] = root / kind.replace(" ", "_")
        shutil.copytree(tiny_model_dir, out[kind])
        damage(out[kind])
    return out


@pytest.mark.parametrize("kind", [*BROKEN_MODELS, "seed 2**70"])
def test_overwrite_with_a_broken_model_leaves_the_finished_run_byte_identical(tmp_path, old_run, broken, kind):
    run, data = old_run
    before = tree(run)
    spec = sft_recipe(tmp_path, data)
    if kind == "seed 2**70":
        spec["run"]["seed"] = 2**70
    else:
        spec["model"] = {"path": str(broken[kind])}
    result = CliRunner().invoke(app, ["sft", str(write(tmp_path / "new.yaml", spec)), "--overwrite"])
    assert result.exit_code != 0 and isinstance(result.exception, (UserError, SystemExit)), result.output
    assert tree(run) == before


def test_a_start_that_fails_after_the_old_run_was_set_aside_gets_it_back(tmp_path, old_run, monkeypatch):
    run, data = old_run
    before = tree(run)

    def no_engine(*args, **kwargs):
        assert (run / ".replaced" / "final" / "model.safetensors").is_file()  # set aside, not deleted
        raise RuntimeError("out of memory while building the engine")

    monkeypatch.setattr("rlrecipe.stages.sft.make_train_engine", no_engine)
    rec = write(tmp_path / "new.yaml", sft_recipe(tmp_path, data, trainer={"lr": 2e-3}))
    result = CliRunner().invoke(app, ["sft", str(rec), "--overwrite"])
    assert isinstance(result.exception, RuntimeError)
    assert tree(run) == before and not (run / ".replaced").exists()
    assert not (run / ".lock.owner").exists()  # the directory was let go


def test_a_start_killed_before_its_first_checkpoint_gets_the_old_run_back_next_time(tmp_path, old_run, capsys):
    run, data = old_run
    before = tree(run)
    spec = sft_recipe(tmp_path, data, trainer={"lr": 2e-3})
    new = Run(LoadedRecipe(recipe=recipe_from_dict(spec), path="new.yaml"), "sft", overwrite=True)
    assert not (run / "final").exists() and (run / ".replaced" / "final").is_dir()
    new.log(1, {"loss": 1.0}, echo=False)
    new._lock._lock.release(force=True)  # as if SIGKILLed: the OS drops the lock, nothing else happens
    old = LoadedRecipe(recipe=recipe_from_dict(sft_recipe(tmp_path, data)), path="r.yaml")
    again = Run(old, "sft", resume=True)
    assert "restored the earlier run" in " ".join(capsys.readouterr().err.split())
    assert again.latest_checkpoint() == run / "checkpoints" / "step_0000002"
    again.release()
    after = tree(run)
    assert {k: v for k, v in after.items() if k not in ("env.json",)} == \
        {k: v for k, v in before.items() if k not in ("env.json",)}  # env.json: rewritten by the resume


def test_the_old_run_is_deleted_once_the_new_one_has_a_checkpoint(tmp_path, old_run):
    run, data = old_run
    spec = sft_recipe(tmp_path, data, trainer={"lr": 2e-3})
    result = CliRunner().invoke(app, ["sft", str(write(tmp_path / "new.yaml", spec)), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not (run / ".replaced").exists() and not (run / ".replaced.drop").exists()
    assert yaml.safe_load((run / "recipe.yaml").read_text())["trainer"]["lr"] == 2e-3
    ident = json.loads((run / "checkpoints" / "step_0000002" / "manifest.json").read_text())["run"]
    assert ident["step"] == 2 and ident["seed"] == 3 and ident["stage"] == "sft"


# -- a checkpoint knows its run ------------------------------------------------------------------
def _other_recipe_resumes(tmp_path, finished, monkeypatch, adopt: bool, **changes):
    root, data = finished
    foreign = root / "runs" / "r" / "checkpoints"
    spec = sft_recipe(tmp_path, data, sft={"max_steps": 3}, **changes)
    rec = write(tmp_path / "mine.yaml", spec)
    mine = tmp_path / "runs" / "r"
    mine.mkdir(parents=True)
    (mine / "env.json").write_text(json.dumps({"stage": "sft"}))  # started, killed before a checkpoint
    shutil.copytree(foreign, mine / "checkpoints")
    if adopt:
        monkeypatch.setenv(ADOPT_ENV, "1")
    return CliRunner().invoke(app, ["sft", str(rec), "--resume", *(["--adopt-checkpoint"] if adopt else [])]), mine


@pytest.mark.parametrize(("changes", "said"), [
    ({"trainer": {"lr": 5e-3}}, "written by another experiment"),
    ({"run": {"seed": 4}}, "written with run.seed 3, this recipe's is 4"),
])
def test_a_checkpoint_of_another_run_is_refused(tmp_path, finished, monkeypatch, changes, said):
    monkeypatch.delenv(ADOPT_ENV, raising=False)
    result, mine = _other_recipe_resumes(tmp_path, finished, monkeypatch, adopt=False, **changes)
    assert isinstance(result.exception, UserError), result.output
    message = str(result.exception)
    assert said in message and "--adopt-checkpoint to resume from it deliberately" in message and "\n" not in message
    assert not (mine / "final").exists()


def test_adopt_checkpoint_resumes_from_it_deliberately(tmp_path, finished, monkeypatch):
    result, mine = _other_recipe_resumes(tmp_path, finished, monkeypatch, adopt=True, trainer={"lr": 5e-3})
    assert result.exit_code == 0, result.output
    assert "resuming from it anyway (--adopt-checkpoint)" in " ".join(result.output.split())
    rows = [json.loads(line) for line in (mine / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3]  # steps 1-2 came from the adopted checkpoint


def test_a_checkpoint_renamed_to_another_step_is_refused(tmp_path, old_run, monkeypatch):
    monkeypatch.delenv(ADOPT_ENV, raising=False)
    run, data = old_run
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step_0000001")
    (ckpts / "step_0000002").rename(ckpts / "step_0000009")
    rec = write(tmp_path / "r.yaml", sft_recipe(tmp_path, data))
    with pytest.raises(UserError, match=r"step_0000009: its manifest records step 2; not resuming"):
        Run(LoadedRecipe(recipe=recipe_from_dict(sft_recipe(tmp_path, data)), path=str(rec)), "sft", resume=True)


def test_an_edited_progress_file_is_refused_even_with_its_manifest_rewritten(tmp_path, monkeypatch):
    """progress.json says step 999, and the manifest was re-listed so sizes and sha256s check out: the
    step recorded at write time still disagrees."""
    from rlrecipe.algo.entropy_watch import EntropyWatch
    from rlrecipe.rl.checkpoint import resume_rl
    from rlrecipe.train.bad_steps import BadStepGuard, rl_step_skipped

    monkeypatch.delenv(ADOPT_ENV, raising=False)
    loaded = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path / "runs")},
                                                   "model": {"tiny": {}}}), path="r.yaml")
    run = Run(loaded, "rl")
    with run.writing_checkpoint(4) as d:
        (d / "trainer").mkdir()
        (d / "progress.json").write_text(json.dumps({"step": 4}))
    run.release()
    ckpt = run.checkpoint_path(4)
    identity = json.loads((ckpt / "manifest.json").read_text())["run"]
    (ckpt / "progress.json").write_text(json.dumps({"step": 999}))
    write_manifest(ckpt, identity)

    class Trainer:
        def load(self, path):
            pass

    resumed = Run(loaded, "rl", resume=True)
    with pytest.raises(UserError, match=r"its state is at step 999, but its manifest records step 4; not resuming"):
        resume_rl(resumed, Trainer(), None, EntropyWatch.from_config(loaded.recipe.rl.entropy_watch, quiet=True),
                  BadStepGuard(3, "rl", rl_step_skipped))


def test_a_checkpoint_without_its_run_identity_is_refused_unless_adopted(tmp_path, monkeypatch, capsys):
    """A manifest regenerated without the run's identity (experiment, seed, stage, step) proves nothing
    about whose checkpoint it is: refused with the fix named, resumed only with --adopt-checkpoint."""
    monkeypatch.delenv(ADOPT_ENV, raising=False)
    loaded = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path / "runs")},
                                                   "model": {"tiny": {}}}), path="r.yaml")
    run = Run(loaded, "sft")
    with run.writing_checkpoint(2) as d:
        (d / "progress.json").write_text(json.dumps({"step": 2}))
    run.release()
    write_manifest(run.checkpoint_path(2))  # sizes and sha256s check out; no identity
    with pytest.raises(UserError, match=r"does not record the run that wrote it .* --adopt-checkpoint"):
        Run(loaded, "sft", resume=True)
    monkeypatch.setenv(ADOPT_ENV, "1")
    resumed = Run(loaded, "sft", resume=True)
    assert resumed.latest_checkpoint() == run.checkpoint_path(2)
    assert "resuming from it anyway (--adopt-checkpoint)" in " ".join(capsys.readouterr().err.split())
    resumed.release()


def test_a_checkpoint_past_the_end_of_the_metrics_is_refused(tmp_path, monkeypatch):
    """A run logs each step before it checkpoints it: a checkpoint of step 6 beside metrics that end at
    step 4 claims steps that were never run here."""
    monkeypatch.delenv(ADOPT_ENV, raising=False)
    loaded = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path / "runs")},
                                                   "model": {"tiny": {}}}), path="r.yaml")
    run = Run(loaded, "sft")
    for step in range(1, 5):
        run.log(step, {"loss": 1.0}, echo=False)
    with run.writing_checkpoint(4) as d:
        (d / "progress.json").write_text(json.dumps({"step": 4}))
    run.release()
    Run(loaded, "sft", resume=True).release()  # its own checkpoint, metrics up to it: resumes
    ckpt4 = run.checkpoint_path(4)
    ckpt6 = run.checkpoint_path(6)
    shutil.copytree(ckpt4, ckpt6)  # the step its directory claims ...
    identity = json.loads((ckpt6 / "manifest.json").read_text())["run"]
    write_manifest(ckpt6, {**identity, "step": 6})  # ... and its manifest, made to agree
    with pytest.raises(UserError, match=r"step_0000006: a checkpoint of step 6, but .*metrics.jsonl ends at step 4"):
        Run(loaded, "sft", resume=True)


# -- SFT's NaN guard -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_model(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("nan") / "model"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("steps", "said"), [
    (5, "sft step 3: loss or gradient was NaN/inf in 3 steps in a row"),
    (1, "the trained weights hold NaN/inf (model.norm.weight); not exporting them"),
])
def test_sft_refuses_to_train_on_or_export_nan(tmp_path, nan_model, steps, said):
    data = write_tiny_data(tmp_path / "data", n=8)
    spec = sft_recipe(tmp_path, data, sft={"max_steps": steps, "save_every": 10})
    spec["model"] = {"path": str(nan_model)}
    result = CliRunner().invoke(app, ["sft", str(write(tmp_path / "r.yaml", spec))])
    assert isinstance(result.exception, UserError) and said in str(result.exception), result.output
    assert not (tmp_path / "runs" / "r" / "final").exists()
    assert not (tmp_path / "runs" / "r" / ".lock.owner").exists()


def test_evaluation_lets_its_records_go(tmp_path, old_run, monkeypatch):
    """`rlrecipe eval` (twice) leaves no lock owner behind: the second finds no stale lock to take over."""
    monkeypatch.chdir(tmp_path)  # eval regenerates RESULTS.md where it runs
    run, data = old_run
    spec = sft_recipe(tmp_path, data)
    spec["eval"] = {"benchmarks": [{"name": "tiny", "path": str(data / "eval.jsonl")}], "n_samples": 1,
                    "max_new_tokens": 8, "pass_k": [1], "max_problems": 2}
    rec = write(tmp_path / "r.yaml", spec)
    for _ in range(2):
        result = CliRunner().invoke(app, ["eval", str(rec)])
        assert result.exit_code == 0, result.output
        assert "stale lock" not in result.output and not (run / "eval" / ".lock.owner").exists()
    assert (run / "eval" / "tiny" / "summary.json").is_file()
