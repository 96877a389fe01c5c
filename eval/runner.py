"""Evaluation: sample n responses per problem through a rollout engine, grade, summarise, record.

`evaluate_benchmarks` is the one path used by `rlrecipe eval` and by training-time validation,
so in-training and standalone numbers agree.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from rlrecipe.eval.metrics import summarize
from rlrecipe.eval.samples import SampleJournal, digest, model_fingerprint, sample_seed

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.data.io import load_rows
from rlrecipe.data.templates import row_prompt_ids
from rlrecipe.recipe.schema import LoadedRecipe, Recipe
from rlrecipe.reward import Grader, grade_trajectories, grader_name
from rlrecipe.rollout.base import SEED_KEY, RolloutEngine
from rlrecipe.run.env import git_state
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def _sample_row(t: Trajectory, text: str) -> dict:
    """One line of samples.jsonl: everything the summary needs, and the response to read."""
    return {"id": t.group_id, "sample": t.uid, "response": text, "answer": t.answers[0],
            "extracted": t.meta.get("extracted"), "correct": t.correct, "status": t.status.value,
            "tokens": len(t.response_ids), "seed": t.meta.get(SEED_KEY)}


def _sample_benchmark(engine: RolloutEngine, tokenizer, grader: Grader, recipe: Recipe, rows: list[dict], n: int,
                      params: SamplingParams, seed: int, journal: SampleJournal, label: str) -> list[dict]:
    """Every sample's row, problem by problem: from the journal where it has one, else generated.

    What is missing is generated in waves of `eval.wave_size` samples, each graded and appended
    to the journal before the next is sent. Every sample carries its own seed, a function of
    (seed, problem, sample index) only, so it comes out the same whichever wave it falls in.
    """
    uid = lambda row, j: f"{row['id']}#{j}"  # noqa: E731
    todo = [(row, j) for row in rows for j in range(n) if uid(row, j) not in journal.done]
    total = len(rows) * n
    if journal.done and todo:
        console.print(f"{label}: resuming with {total - len(todo)} of {total} samples already in {journal.path}")
    prompts: dict[str, list[int]] = {}
    wave_size = recipe.eval.wave_size
    for start in range(0, len(todo), wave_size):
        wave = []
        for row, j in todo[start:start + wave_size]:
            pid = str(row["id"])
            if pid not in prompts:
                prompts[pid] = row_prompt_ids(tokenizer, row, recipe.data.eval_prompt_template, key="problem")
            wave.append(Trajectory(uid=uid(row, j), prompt_ids=prompts[pid], group_id=pid,
                                   answers=[str(row["answer"])], meta={SEED_KEY: sample_seed(seed, pid, j)}))
        engine.generate(wave, params, seed=seed)
        texts = grade_trajectories(wave, tokenizer, grader)
        journal.append([_sample_row(t, text) for t, text in zip(wave, texts, strict=True)])
        if len(todo) > wave_size:
            console.print(f"{label}: {total - len(todo) + start + len(wave)}/{total} samples")
    return [journal.done[uid(row, j)] for row in rows for j in range(n)]


def _journal_key(recipe: Recipe, model: str, rows: list[dict], params: SamplingParams, seed: int) -> str:
    """What decides a sample's content; samples.jsonl is only resumed under the same key."""
    ro = recipe.rollout
    # the grader too: samples.jsonl holds verdicts, which another grader may give differently
    return digest({"model": model_fingerprint(model), "engine": ro.engine, "dtype": ro.dtype, "grader": grader_name(),
                   "template": recipe.data.prompt_template, "params": asdict(params), "seed": seed,
                   "problems": digest([[str(r["id"]), r["problem"], str(r["answer"])] for r in rows])})


def _training_cost(recipe: Recipe) -> dict | None:
    """The run_summary.json of the training run this recipe names, if it has finished one."""
    path = recipe.run.dir / "run_summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def evaluate_benchmarks(recipe: Recipe, engine: RolloutEngine, tokenizer, grader: Grader, *,
                        out_dir: Path | None, model: str, recipe_path: str, recipe_sha256: str,
                        seed: int | None = None, resume: bool = False) -> dict[str, dict]:
    """Evaluate every benchmark of the recipe; write samples.jsonl + summary.json when out_dir is set.

    samples.jsonl grows as samples are graded. With `resume`, the samples an earlier, interrupted
    evaluation of the same model and settings left there are kept and only the rest generated.
    """
    ev = recipe.eval
    seed = recipe.run.seed if seed is None else seed
    summaries = {}
    for bench in ev.benchmarks:
        rows = load_rows(bench.path, "eval")[: ev.max_problems]
        t0 = time.time()
        bdir = None if out_dir is None else out_dir / bench.name
        params = SamplingParams(temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=ev.max_new_tokens,
                                greedy=ev.temperature == 0)
        journal = SampleJournal(None if bdir is None else bdir / "samples.jsonl",
                                _journal_key(recipe, model, rows, params, seed), resume=resume)
        reused = len(journal.done)
        samples = _sample_benchmark(engine, tokenizer, grader, recipe, rows, ev.n_samples, params, seed, journal,
                                    bench.name)
        per_problem: dict[str, list[bool]] = {}
        for r in samples:
            per_problem.setdefault(r["id"], []).append(bool(r["correct"]))
        summary = summarize(per_problem, [k for k in ev.pass_k if k <= ev.n_samples])
        if ev.greedy:
            gparams = SamplingParams(max_new_tokens=ev.max_new_tokens, greedy=True)
            gjournal = SampleJournal(None if bdir is None else bdir / "greedy.jsonl",
                                     _journal_key(recipe, model, rows, gparams, seed), resume=resume)
            greedy = _sample_benchmark(engine, tokenizer, grader, recipe, rows, 1, gparams, seed, gjournal,
                                       f"{bench.name} (greedy)")
            summary["greedy_acc"] = sum(bool(r["correct"]) for r in greedy) / max(1, len(greedy))
        summary.update({
            "benchmark": bench.name, "model": model, "recipe": recipe_path, "recipe_sha256": recipe_sha256,
            "experiment_sha256": recipe.experiment_sha256(), "algorithm_sha256": recipe.algorithm_sha256(),
            "seed": recipe.run.seed,
            "run": recipe.run.name, "commit": git_state()["commit"], "date": datetime.now(UTC).isoformat(),
            "grader": grader_name(),
            "temperature": ev.temperature, "top_p": ev.top_p, "max_new_tokens": ev.max_new_tokens,
            "wall_time_s": round(time.time() - t0, 3),
            "tokens_generated": sum(r["tokens"] for r in samples),
            "truncated": sum(r["status"] == Status.TRUNCATED.value for r in samples),
            "resumed_samples": reused,
            "reference": bench.reference or None,
            "training": _training_cost(recipe),
        })
        summaries[bench.name] = summary
        if bdir is not None:
            atomic_write_text(bdir / "summary.json", json.dumps(summary, indent=2))
    return summaries


def evaluate_model_dir(loaded: LoadedRecipe, model_dir: str | Path, out_dir: Path) -> dict[str, dict]:
    """Standalone evaluation of an HF model directory with the recipe's eval section; resumes an
    interrupted one from the samples it wrote."""
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.rollout.factory import make_rollout_engine

    recipe = loaded.recipe
    if not recipe.eval.benchmarks:
        raise UserError(f"{loaded.path}: eval.benchmarks is empty: nothing to evaluate")
    if not (Path(model_dir) / "config.json").exists():
        raise UserError(f"{model_dir}: no model there (train first, or pass --model PATH)")
    tokenizer = load_tokenizer(model_dir)
    engine = make_rollout_engine(recipe, model_dir, tokenizer, run_dir=out_dir)
    try:
        with Grader(timeout=2.0) as grader:
            return evaluate_benchmarks(recipe, engine, tokenizer, grader, out_dir=out_dir, model=str(model_dir),
                                       recipe_path=loaded.path, recipe_sha256=loaded.sha256, resume=True)
    finally:
        engine.close()
