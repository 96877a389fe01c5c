"""Evaluation streams samples.jsonl wave by wave and resumes a killed eval with the same numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rlrecipe.eval.runner import evaluate_benchmarks
from rlrecipe.eval.samples import SampleJournal, sample_seed

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.schema import recipe_from_dict
from rlrecipe.reward import Grader
from rlrecipe.rollout.base import SEED_KEY
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.helpers import beside, write_recipe, write_tiny_data

# the numbers a resumed eval must reproduce (timing, dates and resume counts may differ)
SAME = ("avg", "stderr", "n", "num_problems", "num_samples", "num_correct", "pass_at_k", "per_problem",
        "tokens_generated", "truncated")


def _row(uid: str) -> dict:
    return {"id": uid.split("#")[0], "sample": uid, "correct": True, "status": "finished", "tokens": 3}


# -- the journal -------------------------------------------------------------------------------
def test_journal_drops_a_cut_last_line_and_appends_after_it(tmp_path):
    path = tmp_path / "samples.jsonl"
    SampleJournal(path, "k").append([_row("a#0"), _row("a#1")])
    with open(path, "a") as f:
        f.write('{"id": "a", "sample": "a#2", "corr')  # what a kill mid-write leaves
    journal = SampleJournal(path, "k")
    assert sorted(journal.done) == ["a#0", "a#1"]
    journal.append([_row("a#2")])
    assert [json.loads(line)["sample"] for line in path.read_text().splitlines()] == ["a#0", "a#1", "a#2"]


def test_journal_refuses_a_broken_line_before_the_end(tmp_path):
    path = tmp_path / "samples.jsonl"
    SampleJournal(path, "k").append([_row("a#0")])
    with open(path, "a") as f:
        f.write("garbage\n" + json.dumps(_row("a#1")) + "\n")
    with pytest.raises(UserError, match=r"samples\.jsonl:2: not a sample row"):
        SampleJournal(path, "k")


def test_journal_sets_aside_samples_of_other_settings(tmp_path):
    path = tmp_path / "samples.jsonl"
    SampleJournal(path, "old").append([_row("a#0")])
    assert SampleJournal(path, "new").done == {}
    assert not path.exists() and (tmp_path / "samples.jsonl.stale").exists()
    SampleJournal(path, "new").append([_row("b#0")])
    assert SampleJournal(path, "new", resume=False).done == {} and not path.exists()


# -- per-sample seeds --------------------------------------------------------------------------
def test_a_seeded_sample_does_not_depend_on_its_batch(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = InProcessEngine(tiny_model_dir, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=24)

    def traj(i, seeded=True):
        return Trajectory(uid=str(i), prompt_ids=tok.encode(f"Add {i * 41} and {i + 7}."),
                          meta={SEED_KEY: sample_seed(5, str(i), 0)} if seeded else {})

    alone = engine.generate([traj(3)], params, seed=0)[0]
    crowd = engine.generate([traj(i) for i in range(6)], params, seed=99)
    assert crowd[3].response_ids == alone.response_ids
    # without its own seed, a row's sample changes with its batch (the seeds above matter)
    shared_alone = engine.generate([traj(3, False)], params, seed=0)[0]
    shared_crowd = engine.generate([traj(i, False) for i in range(6)], params, seed=0)[3]
    assert shared_crowd.response_ids != shared_alone.response_ids
    # a different sample index of the same problem draws a different response
    other = traj(3)
    other.meta[SEED_KEY] = sample_seed(5, "3", 1)
    assert engine.generate([other], params, seed=0)[0].response_ids != alone.response_ids


# -- evaluate_benchmarks -----------------------------------------------------------------------
class CountingEngine(InProcessEngine):
    generated = 0

    def generate(self, trajs, params, **kw):
        self.generated += len(trajs)
        return super().generate(trajs, params, **kw)


def _recipe(tmp_path, data, model_dir, out, **ev):
    return {"run": {"name": "ev", "seed": 7, "output_dir": str(tmp_path / out)},
            "model": {"path": str(model_dir)},
            "data": {"prompt_template": "plain"},
            "eval": {"benchmarks": [{"name": "tiny", "path": str(data / "eval.jsonl")}], "n_samples": 3,
                     "max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0, "pass_k": [1, 2], **ev}}


def test_resume_generates_only_the_missing_samples_with_equal_numbers(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data", n=8)
    tok = load_tokenizer(tiny_model_dir)

    def evaluate(out, wave_size):
        recipe = recipe_from_dict(_recipe(tmp_path, data, tiny_model_dir, "runs", wave_size=wave_size))
        engine = CountingEngine(tiny_model_dir, tok.eos_token_id, tok.pad_token_id, dtype="float32", max_batch=8)
        with Grader(timeout=2.0) as grader:
            summary = evaluate_benchmarks(recipe, engine, tok, grader, out_dir=out, model=str(tiny_model_dir),
                                          recipe_path="r.yaml", recipe_sha256="x", resume=True)["tiny"]
        return summary, engine.generated

    full, generated = evaluate(tmp_path / "a", wave_size=24)  # one wave
    assert generated == 24 and full["num_samples"] == 24 and full["resumed_samples"] == 0
    lines = (tmp_path / "a/tiny/samples.jsonl").read_text().splitlines()
    assert len(lines) == 24

    # an interrupted eval elsewhere: 10 samples written, the 11th cut short
    (tmp_path / "b/tiny").mkdir(parents=True)
    for name in ("samples.jsonl.key",):
        (tmp_path / "b/tiny" / name).write_text((tmp_path / "a/tiny" / name).read_text())
    (tmp_path / "b/tiny/samples.jsonl").write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])
    resumed, generated = evaluate(tmp_path / "b", wave_size=4)  # other waves: same samples all the same
    assert generated == 14 and resumed["resumed_samples"] == 10
    assert {k: resumed[k] for k in SAME} == {k: full[k] for k in SAME}
    got = sorted(json.loads(line)["sample"] for line in (tmp_path / "b/tiny/samples.jsonl").read_text().splitlines())
    assert got == sorted(json.loads(line)["sample"] for line in lines)

    # everything there already: nothing generated, same numbers
    again, generated = evaluate(tmp_path / "b", wave_size=4)
    assert generated == 0 and {k: again[k] for k in SAME} == {k: full[k] for k in SAME}


# -- a real kill -------------------------------------------------------------------------------
def _eval_cmd(recipe, model_dir):
    return [sys.executable, "-m", "rlrecipe.cli.app", "eval", str(recipe), "--model", str(model_dir)]


@pytest.mark.slow
def test_killed_eval_resumes_to_the_uninterrupted_numbers(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data", n=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    settings = dict(n_samples=4, max_new_tokens=48, wave_size=1)  # 32 waves of one sample
    killed = write_recipe(tmp_path / "killed.yaml", _recipe(tmp_path, data, tiny_model_dir, "runs_killed", **settings))
    whole = write_recipe(tmp_path / "whole.yaml", _recipe(tmp_path, data, tiny_model_dir, "runs_whole", **settings))
    samples = tmp_path / "runs_killed/ev/eval/tiny/samples.jsonl"

    with beside(_eval_cmd(whole, tiny_model_dir), tmp_path / "whole.log", cwd=tmp_path, env=env):  # uninterrupted
        proc = subprocess.Popen(_eval_cmd(killed, tiny_model_dir), cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            while not (samples.exists() and samples.read_text().count("\n") >= 3):
                assert proc.poll() is None, f"eval ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
                assert time.monotonic() < deadline, "no samples written in 300 s"
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        text = samples.read_text()
        kept = text[:text.rfind("\n") + 1].splitlines()  # the complete lines
        assert 3 <= len(kept) < 32
        assert not (samples.parent / "summary.json").exists()
        with open(samples, "a") as f:
            f.write('{"id": "0", "sample": "0#')  # and a line the kill cut short

        out = subprocess.run(_eval_cmd(killed, tiny_model_dir), cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    resumed = json.loads((samples.parent / "summary.json").read_text())
    uninterrupted = json.loads((tmp_path / "runs_whole/ev/eval/tiny/summary.json").read_text())
    assert resumed["resumed_samples"] >= len(kept) and uninterrupted["resumed_samples"] == 0
    assert {k: resumed[k] for k in SAME} == {k: uninterrupted[k] for k in SAME}
    after = samples.read_text().splitlines()
    assert after[:len(kept)] == kept and len(after) == 32  # what it had stays; nothing twice


def test_samples_graded_by_another_grader_are_not_resumed(monkeypatch):
    from rlrecipe.eval import runner

    from rlrecipe.recipe.schema import recipe_from_dict
    from rlrecipe.trajectory.record import SamplingParams

    recipe = recipe_from_dict({"run": {"name": "r"}, "model": {"tiny": {}}})
    rows = [{"id": 1, "problem": "1+1", "answer": "2"}]
    key = runner._journal_key(recipe, "m", rows, SamplingParams(), 1)
    assert runner._journal_key(recipe, "m", rows, SamplingParams(), 1) == key
    monkeypatch.setattr(runner, "grader_name", lambda: "math-verify 9.9.9")
    assert runner._journal_key(recipe, "m", rows, SamplingParams(), 1) != key
