"""A run's record: `runs/<name>/` locked for the run's life, the resolved recipe, its sha256 and
environment; its checkpoints (checkpoints.py), metrics (metrics_log.py) and the earlier run an
`--overwrite` replaces (overwrite.py) each kept by a part of their own."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.core.threads import thread_change, thread_record
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.run.checkpoints import Checkpoints, RunIdentity, refuse_or_warn, step_of
from rlrecipe.run.env import environment
from rlrecipe.run.lock import RunLock
from rlrecipe.run.metrics_file import read_metrics
from rlrecipe.run.metrics_log import MetricsLog
from rlrecipe.run.overwrite import SetAside
from rlrecipe.run.same_experiment import check_same_experiment, recorded_experiment


class Run:
    """`runs/<name>/`: the resolved recipe, its sha256, environment, metrics, checkpoints.

    The directory is locked for the run's life. A fresh start clears only what a run killed
    before its first checkpoint leaves (metrics); it refuses a directory holding another
    stage's run, a checkpoint or a final model unless `overwrite`. A resume picks the newest
    checkpoint whose manifest checks out and cuts the metrics back to it.
    """

    def __init__(self, loaded: LoadedRecipe, stage: str, resume: bool = False, subdir: str | None = None,
                 overwrite: bool = False):
        """`subdir` keeps a later stage's records (eval) beside, not over, the training run's."""
        if resume and overwrite:
            raise UserError("--resume and --overwrite exclude each other: continue the run, or start it over")
        self._set_paths(loaded, stage, subdir)
        if resume and not (self.dir / "env.json").is_file() and not SetAside.exists_in(self.dir):
            raise UserError(f"{self.dir}: --resume, but no run was ever started here; leave out --resume to start "
                            "it (or check run.name and run.output_dir)")
        _make_dir(self.dir, "run.output_dir")
        self._lock = RunLock(self.dir)
        note = self._lock.acquire()
        if note:
            console.print(f"[yellow]{note}[/]", highlight=False, soft_wrap=True)
        try:
            self._start(resume, overwrite)
        except BaseException:
            self.abandon()
            raise

    def _set_paths(self, loaded: LoadedRecipe, stage: str, subdir: str | None) -> None:
        """Where this run's records go; writes nothing."""
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.stage = stage
        self.run_dir = self.recipe.run.dir
        self.dir = self.run_dir / subdir if subdir else self.run_dir
        self.metrics_path = self.dir / "metrics.jsonl"
        self.resume_from: Path | None = None
        identity = RunIdentity(loaded.recipe.experiment_sha256(), self.recipe.run.seed, stage)
        self.checkpoints = Checkpoints(self.dir / "checkpoints", identity, self.recipe.run.keep_checkpoints)
        self.ckpt_dir = self.checkpoints.dir
        self.metrics = MetricsLog(self.metrics_path, stage)
        self._aside = SetAside(self.dir, with_final=self.dir == self.run_dir)

    def _start(self, resume: bool, overwrite: bool) -> None:
        self._aside.restore()
        earlier = self._earlier_stage()
        if earlier not in (None, self.stage) and not overwrite:
            raise UserError(f"{self.dir}: holds an earlier {earlier!r} run; --overwrite to replace it, or "
                            "choose another run.name")
        if resume:
            self._start_resumed()
        else:
            self._start_fresh(overwrite)
        self._write_records()

    def _start_resumed(self) -> None:
        experiments = {self.recipe.experiment_sha256()}  # what a resumed checkpoint may have been written by
        recorded = self.dir / "recipe.sha256"
        if recorded.exists() and recorded.read_text().split()[0] != self.loaded.sha256:
            check_same_experiment(self.dir, self.loaded)
            experiments.add(recorded_experiment(self.dir))
        self.resume_from = self.checkpoints.pick(experiments)
        self._note_thread_change()
        step = step_of(self.resume_from) if self.resume_from else 0
        if self.resume_from is not None:
            self._check_metrics_reach(step)
        self.truncate_metrics(step)

    def _check_metrics_reach(self, step: int) -> None:
        """Each step is logged before it can be checkpointed: metrics that stop short of the
        checkpoint's step belong to another run, or the checkpoint claims steps never run."""
        logged = [row.get("step", 0) for row in read_metrics(self.metrics_path)]
        if logged and max(logged) < step:
            refuse_or_warn(f"{self.resume_from}: a checkpoint of step {step}, but {self.metrics_path} ends at "
                           f"step {max(logged)}")

    def _start_fresh(self, overwrite: bool) -> None:
        held = self._earlier_work()
        if held and not overwrite:
            raise UserError(f"{self.dir}: holds {held} of an earlier run; --resume to continue it, "
                            "--overwrite to start over, or choose another run.name")
        if overwrite:
            self._aside.set_aside()
        else:
            self._clear()

    def _write_records(self) -> None:
        loaded = self.loaded
        self.ckpt_dir.mkdir(exist_ok=True)
        atomic_write_text(self.dir / "recipe.yaml", self.recipe.to_yaml())
        atomic_write_text(self.dir / "recipe.sha256", f"{loaded.sha256}  {loaded.path}\n")
        meta = {"stage": self.stage, "recipe_path": loaded.path, "recipe_sha256": loaded.sha256,
                "algorithm_sha256": self.recipe.algorithm_sha256(),
                "overrides": loaded.overrides, "seed": self.recipe.run.seed, "started": time.time(),
                **environment()}
        atomic_write_text(self.dir / "env.json", json.dumps(meta, indent=2))
        self._num_gpus = len(meta["gpus"])
        self.metrics.started = time.time()  # this session's clock (ETA, wall time): from when its records are written
        if self.recipe.run.tracking.wandb:
            self.metrics.start_wandb(self.recipe.run.tracking, self.recipe.run.name, self.dir,
                                     self.recipe.model_dump(mode="json"))

    def _note_thread_change(self) -> None:
        try:
            recorded = json.loads((self.dir / "env.json").read_text()).get("cpu")
        except (OSError, ValueError):
            return
        change = thread_change(recorded, thread_record())
        if change:
            console.print(f"[yellow]{self.dir}: {change}[/]", highlight=False, soft_wrap=True)

    def abandon(self) -> None:
        """The stage failed: an earlier run set aside by --overwrite comes back (unless a checkpoint of
        this one was written), and the directory is let go, with no owner left behind."""
        if getattr(self, "_lock", None) is None or not self._lock.held:
            return
        try:
            if self._aside.held is not None:
                self._aside.restore()
        finally:
            self.release()

    # -- what an earlier run left ------------------------------------------------------------
    def _earlier_stage(self) -> str | None:
        try:
            stage = json.loads((self.dir / "env.json").read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            return None
        return stage if isinstance(stage, str) else None

    def _earlier_work(self) -> str | None:
        """What a fresh start would destroy: checkpoints or a final model."""
        ckpts = self.checkpoints.newest_first()
        if ckpts:
            return f"checkpoints (up to {ckpts[0].name})"
        if (self.final_model_dir / "config.json").exists() and self.dir == self.run_dir:
            return f"a final model ({self.final_model_dir})"
        return None

    def _clear(self) -> None:
        """A fresh start must not mix with an earlier run of the same name."""
        shutil.rmtree(self.ckpt_dir, ignore_errors=True)
        self.metrics_path.unlink(missing_ok=True)
        (self.dir / "run_summary.json").unlink(missing_ok=True)
        if self.dir == self.run_dir:
            shutil.rmtree(self.final_model_dir, ignore_errors=True)

    # -- metrics ------------------------------------------------------------------------------
    def truncate_metrics(self, after_step: int) -> None:
        self.metrics.truncate(after_step)

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True, total: int | None = None) -> None:
        self.metrics.log(step, metrics, echo=echo, total=total)

    def finish(self, token_columns: tuple[str, ...] = ()) -> None:
        """Write run_summary.json: the cost of the run (GPU-hours, tokens) for RESULTS.md and notes."""
        wall = time.time() - self.metrics.started
        summary = {"stage": self.stage, "wall_time_s_this_session": round(wall, 1), "gpus": self._num_gpus,
                   "gpu_hours_this_session": round(self._num_gpus * wall / 3600, 3),
                   **self.metrics.totals(token_columns)}
        atomic_write_text(self.dir / "run_summary.json", json.dumps(summary, indent=2))
        self.metrics.close()
        self._aside.drop()
        self.release()

    def release(self) -> None:
        """Let the next process in (the OS lets go by itself if this one dies)."""
        self._lock.release()

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints.path(step)

    def writing_checkpoint(self, step: int):
        """Write into a temp dir, then rename: a kill leaves either the old or the new checkpoint. The
        first checkpoint of an `--overwrite` start lets the run it replaces go."""
        return self.checkpoints.writing(step, on_written=self._aside.drop)

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint this run resumes from (chosen and verified when it started), or None."""
        return self.resume_from

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "final"


def _make_dir(path: Path, field: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"{field}: cannot write run records in {path}: {err.strerror or err}") from None


def resolve_init(init_from: str | None, output_dir: str) -> str | None:
    """`run:<name>` means the final HF export of another run in the same output dir."""
    if init_from and init_from.startswith("run:"):
        return str(Path(output_dir) / init_from[4:] / "final")
    return init_from


def latest_run(output_dir: str = "runs") -> Path | None:
    root = Path(output_dir)
    if not root.exists():
        return None
    runs = [p for p in root.iterdir() if (p / "env.json").exists() and (p / "final").exists()]
    return max(runs, key=lambda p: (p / "final").stat().st_mtime) if runs else None
