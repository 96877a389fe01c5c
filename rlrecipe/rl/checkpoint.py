"""An RL run's checkpoint: what a step saves beside the run record's own (the trainer, the rollout
pool, the schedule's batches collected ahead, progress.json) and how a run resumes from the latest
one (its step, and the streak counts of the entropy alarms and the bad-step guard).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlrecipe.algo.entropy_watch import EntropyWatch
from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.dist import broadcast_from_rank_zero
from rlrecipe.rl.pool import RolloutPool
from rlrecipe.rl.schedule import StepRollout
from rlrecipe.run.checkpoints import check_resume_step
from rlrecipe.run.metrics_file import read_metrics
from rlrecipe.run.record import Run
from rlrecipe.train.bad_steps import BadStepGuard

POOL_FILE = "pool.safetensors"


def save_rl_checkpoint(run: Run, step: int, trainer, pool: RolloutPool | None, rollout: StepRollout) -> None:
    """trainer/ (every rank's part), the pool's arrays, the schedule's batches collected ahead and
    progress.json (rank 0)."""
    with run.writing_checkpoint(step) as d:
        if pool is not None:
            rollout.save(d)  # first: it waits for the worker, so the pool saved below is the one it left
        trainer.save(d / "trainer")
        if pool is not None:
            pool.save(d / POOL_FILE)
            atomic_write_text(d / "progress.json", json.dumps({"step": step}))


def resume_rl(run: Run, trainer, pool: RolloutPool | None, watch: EntropyWatch, guard: BadStepGuard
              ) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint it was read from: 0 and None, or the chosen
    checkpoint's (trainer, pool, metrics and the streak counts restored; the schedule restores its
    own batches collected ahead from it)."""
    ckpt = broadcast_from_rank_zero(run.latest_checkpoint)
    if ckpt is None:
        return 0, None
    trainer.load(ckpt / "trainer")
    start = json.loads((ckpt / "progress.json").read_text())["step"]
    check_resume_step(ckpt, start)  # an edited progress.json must not skip or repeat steps
    if pool is not None:
        pool.load(ckpt / POOL_FILE)
        run.truncate_metrics(start)
        console.print(f"resumed from {ckpt} at step {start}")
    resume_streaks(run, watch, guard)
    return start, ckpt


def resume_streaks(run: Run, watch: EntropyWatch, guard: BadStepGuard) -> None:
    """The entropy alarms' and the bad-step guard's counts of steps in a row, from the metrics kept up
    to the checkpoint (rank 0's, on every rank): a streak a kill interrupted goes on counting."""
    rows = broadcast_from_rank_zero(lambda: read_metrics(run.metrics_path))
    watch.resume(r["entropy"] for r in rows)
    guard.resume(rows)
