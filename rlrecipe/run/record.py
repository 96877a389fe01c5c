"""Run records: the run directory, its metrics, atomic checkpoints (environment capture: run_env.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.core.threads import thread_change, thread_record
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, _digest, recipe_from_dict
from rlrecipe.run.env import environment
from rlrecipe.run.lock import RunLock
from rlrecipe.run.manifest import check_manifest, read_identity, write_manifest
from rlrecipe.run.metrics_file import metric_lines, read_metrics

# `--overwrite` moves the earlier run here and deletes it only once the new run has written its
# first checkpoint; a start that fails (or is killed) before that gets the earlier run back.
REPLACED = ".replaced"
REPLACED_ITEMS = ("checkpoints", "metrics.jsonl", "run_summary.json", "final", "recipe.yaml", "recipe.sha256",
                  "env.json", "init_model", "validation", "validation_model")
# Resuming from a checkpoint another experiment (or seed, or stage) wrote, or whose state disagrees
# with the step its manifest records, is refused unless this is set (`--adopt-checkpoint`).
ADOPT_ENV = "RLRECIPE_ADOPT_CHECKPOINT"

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
        if resume and not (self.dir / "env.json").is_file() and not (self.dir / REPLACED).is_dir():
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
        self.ckpt_dir = self.dir / "checkpoints"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.resume_from: Path | None = None
        self._wandb = None
        self._aside: Path | None = None  # the earlier run `--overwrite` moved away, until a first checkpoint
        self._experiments = {loaded.recipe.experiment_sha256()}  # what a resumed checkpoint may have been written by

    def _start(self, resume: bool, overwrite: bool) -> None:
        loaded = self.loaded
        self._restore_replaced()
        earlier = self._earlier_stage()
        if earlier not in (None, self.stage) and not overwrite:
            raise UserError(f"{self.dir}: holds an earlier {earlier!r} run; --overwrite to replace it, or "
                            "choose another run.name")
        if resume:
            recorded = self.dir / "recipe.sha256"
            if recorded.exists() and recorded.read_text().split()[0] != loaded.sha256:
                self._check_same_experiment(loaded)
                self._experiments.add(self._recorded_experiment())
            self.resume_from = self._pick_checkpoint()
            self._note_thread_change()
            self.truncate_metrics(_step_of(self.resume_from) if self.resume_from else 0)
        else:
            held = self._earlier_work()
            if held and not overwrite:
                raise UserError(f"{self.dir}: holds {held} of an earlier run; --resume to continue it, "
                                "--overwrite to start over, or choose another run.name")
            if overwrite:
                self._set_aside()
            else:
                self._clear()
        self.ckpt_dir.mkdir(exist_ok=True)
        atomic_write_text(self.dir / "recipe.yaml", self.recipe.to_yaml())
        atomic_write_text(self.dir / "recipe.sha256", f"{loaded.sha256}  {loaded.path}\n")
        meta = {"stage": self.stage, "recipe_path": loaded.path, "recipe_sha256": loaded.sha256,
                "overrides": loaded.overrides, "seed": self.recipe.run.seed, "started": time.time(),
                **environment()}
        atomic_write_text(self.dir / "env.json", json.dumps(meta, indent=2))
        self._num_gpus = len(meta["gpus"])
        self._started = time.time()
        self._first_logged: tuple[int, float] | None = None  # (step before, time) when this session began
        self._wandb = None
        if self.recipe.run.tracking.wandb:
            self._start_wandb()

    def _note_thread_change(self) -> None:
        try:
            recorded = json.loads((self.dir / "env.json").read_text()).get("cpu")
        except (OSError, ValueError):
            return
        change = thread_change(recorded, thread_record())
        if change:
            console.print(f"[yellow]{self.dir}: {change}[/]", highlight=False, soft_wrap=True)

    def _check_same_experiment(self, loaded: LoadedRecipe) -> None:
        """A resume under another sha256 than the run started with: refused, naming the fields that
        differ, unless the only difference is fields the schema gained since, at their defaults (a
        newer rlrecipe reading the same recipe: its sha256 covers every default). Then said, and
        the run goes on under the new sha256."""
        refuse = f"{loaded.path}: recipe differs from the one {self.dir} was started with"
        try:
            was = _flat(yaml.safe_load((self.dir / "recipe.yaml").read_text(encoding="utf-8")))
        except (OSError, yaml.YAMLError, AttributeError):
            raise RecipeError(f"{refuse}; resume with the same recipe or choose another run.name") from None
        now = _flat(loaded.recipe.model_dump(mode="json"))
        explicit = _flat(loaded.recipe.model_dump(mode="json", exclude_defaults=True))
        changed = sorted(k for k in was.keys() & now.keys() if was[k] != now[k])
        gone = sorted(was.keys() - now.keys())
        added = sorted(now.keys() - was.keys())
        set_new = [k for k in added if k in explicit]
        if changed or gone or set_new:
            parts = [f"{k}: {was[k]!r} -> {now[k]!r}" for k in changed] + [f"{k} no longer exists" for k in gone]
            parts += [f"{k}: new, set to {now[k]!r}" for k in set_new]
            shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
            raise RecipeError(f"{refuse} ({shown}); resume with the same recipe or choose another run.name")
        console.print(f"{self.dir}: resuming with {len(added)} field(s) added to the recipe schema since it started, "
                      f"at their defaults: {', '.join(added)}", highlight=False, soft_wrap=True)

    def _recorded_experiment(self) -> str | None:
        """The experiment sha256 of the recipe.yaml the run was started with (as Recipe.experiment_sha256)."""
        try:
            d = yaml.safe_load((self.dir / "recipe.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
        try:  # through the schema, so that fields hashed only when set are left out as they are now
            return recipe_from_dict(d).experiment_sha256()
        except (RecipeError, TypeError, ValueError):
            pass
        try:
            for key in ("seed", "name", "output_dir"):
                d["run"].pop(key, None)
        except (AttributeError, KeyError, TypeError):
            return None
        return _digest(d)

    # -- --overwrite: the earlier run moved aside, deleted once the new one has a checkpoint ---------
    def _items(self) -> list[str]:
        return [n for n in REPLACED_ITEMS if n != "final" or self.dir == self.run_dir]

    def _set_aside(self) -> None:
        aside = self.dir / REPLACED
        aside.mkdir()
        for name in self._items():
            if (self.dir / name).exists():
                os.replace(self.dir / name, aside / name)
        self._aside = aside
        console.print(f"{self.dir}: the earlier run is kept in {aside} until this one writes its first checkpoint",
                      highlight=False, soft_wrap=True)

    def _restore_replaced(self) -> None:
        """An `--overwrite` start that ended before its first checkpoint: its earlier run comes back."""
        shutil.rmtree(self.dir / (REPLACED + ".drop"), ignore_errors=True)  # a deletion a kill interrupted
        aside = self.dir / REPLACED
        if not aside.is_dir():
            return
        for name in self._items():
            _remove(self.dir / name)
            if (aside / name).exists():
                os.replace(aside / name, self.dir / name)
        shutil.rmtree(aside)
        self._aside = None
        console.print(f"[yellow]{self.dir}: restored the earlier run that an --overwrite start set aside; that start "
                      "ended before its first checkpoint[/]", highlight=False, soft_wrap=True)

    def _drop_replaced(self) -> None:
        if self._aside is None:
            return
        dropping = self._aside.with_name(REPLACED + ".drop")
        os.replace(self._aside, dropping)  # atomic: a kill mid-delete cannot leave half an earlier run to restore
        shutil.rmtree(dropping, ignore_errors=True)
        self._aside = None

    def abandon(self) -> None:
        """The stage failed: an earlier run set aside by --overwrite comes back (unless a checkpoint of
        this one was written), and the directory is let go, with no owner left behind."""
        if getattr(self, "_lock", None) is None or not self._lock.held:
            return
        try:
            if self._aside is not None:
                self._restore_replaced()
        finally:
            self.release()

    # -- what an earlier run left ------------------------------------------------------------
    def _earlier_stage(self) -> str | None:
        try:
            stage = json.loads((self.dir / "env.json").read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            return None
        return stage if isinstance(stage, str) else None

    def _checkpoints(self) -> list[Path]:
        """Checkpoint directories by step, newest first (unfinished `.partial` ones left out)."""
        if not self.ckpt_dir.is_dir():
            return []
        found = [p for p in self.ckpt_dir.iterdir() if p.is_dir() and _step_of(p) is not None]
        return sorted(found, key=_step_of, reverse=True)

    def _earlier_work(self) -> str | None:
        """What a fresh start would destroy: checkpoints or a final model."""
        ckpts = self._checkpoints()
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

    def _pick_checkpoint(self) -> Path | None:
        """The newest checkpoint that is complete; says which, and why newer ones were passed over."""
        ckpts = self._checkpoints()
        marker = self.ckpt_dir / "latest"
        named = marker.read_text().strip() if marker.is_file() else None
        if named and not (self.ckpt_dir / named).is_dir():
            console.print(f"[yellow]{marker} names {named}, which is missing[/]", highlight=False, soft_wrap=True)
        if not ckpts:
            console.print(f"no checkpoint in {self.ckpt_dir}: starting from step 0", highlight=False, soft_wrap=True)
            return None
        for path in ckpts:
            problem = check_manifest(path)
            if problem is None:
                self._check_identity(path)
                if path.name != named or path != ckpts[0]:
                    console.print(f"[yellow]resuming from {path.name}, the newest complete checkpoint[/]",
                                  highlight=False, soft_wrap=True)
                return path
            console.print(f"[yellow]{path}: damaged or incomplete ({problem}); not resuming from it[/]",
                          highlight=False, soft_wrap=True)
        raise UserError(f"{self.ckpt_dir}: none of the {len(ckpts)} checkpoints is complete; --overwrite to "
                        "start over")

    def _check_identity(self, path: Path) -> None:
        """A checkpoint resumes only the run that wrote it: same experiment, seed and stage, and the
        step its manifest records is the one its name says."""
        ident = read_identity(path)
        if ident is None:
            console.print(f"[yellow]{path}: written before checkpoints recorded their run; resuming without "
                          "checking that it is this recipe's[/]", highlight=False, soft_wrap=True)
            return
        problems = []
        if ident.get("experiment_sha256") not in self._experiments:
            problems.append(f"written by another experiment (sha256 {str(ident.get('experiment_sha256'))[:12]}, "
                            f"this recipe's is {self.recipe.experiment_sha256()[:12]})")
        if ident.get("seed") != self.recipe.run.seed:
            problems.append(f"written with run.seed {ident.get('seed')}, this recipe's is {self.recipe.run.seed}")
        if ident.get("stage") != self.stage:
            problems.append(f"written by the {ident.get('stage')!r} stage")
        if ident.get("step") != _step_of(path):
            problems.append(f"its manifest records step {ident.get('step')}")
        if problems:
            refuse_or_warn(f"{path}: {'; '.join(problems)}")

    def _start_wandb(self) -> None:
        tr = self.recipe.run.tracking
        os.environ.setdefault("WANDB_MODE", tr.mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb.init(project=tr.project, name=f"{self.recipe.run.name}-{self.stage}",
                                 dir=str(self.dir), config=self.recipe.model_dump(mode="json"),
                                 resume="allow", id=f"{self.recipe.run.name}-{self.stage}")

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop metric lines written after the checkpoint we resume from, and a line
        a kill cut short."""
        if self.metrics_path.exists():
            kept = [ln for ln, row in metric_lines(self.metrics_path) if row.get("step", 0) <= after_step]
            atomic_write_text(self.metrics_path, "".join(ln + "\n" for ln in kept))

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True, total: int | None = None) -> None:
        """Append one metrics row; with `echo`, print it, and with `total` the steps left and an ETA."""
        row = {"step": step, "stage": self.stage, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._first_logged is None:
            self._first_logged = (step - 1, self._started)
        if echo:
            shown = "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if not isinstance(v, (list, dict)))
            where = f"step {step}" if total is None else f"step {step}/{total} ({self._eta(step, total)})"
            console.print(f"[bold]{self.stage}[/] {where}: {shown}", highlight=False)

    def _eta(self, step: int, total: int) -> str:
        """Time left at this session's pace (steps since it started or resumed)."""
        first, t0 = self._first_logged
        per_step = (time.time() - t0) / max(step - first, 1)
        left = per_step * (total - step)
        return f"{per_step:.1f} s/step, eta {_duration(left)}"

    def finish(self, token_columns: tuple[str, ...] = ()) -> None:
        """Write run_summary.json: the cost of the run (GPU-hours, tokens) for RESULTS.md and notes."""
        totals = {f"{c}_total": 0 for c in token_columns}
        for row in read_metrics(self.metrics_path):
            for c in token_columns:
                totals[f"{c}_total"] += row.get(c, 0)
        wall = time.time() - self._started
        summary = {"stage": self.stage, "wall_time_s_this_session": round(wall, 1), "gpus": self._num_gpus,
                   "gpu_hours_this_session": round(self._num_gpus * wall / 3600, 3), **totals}
        atomic_write_text(self.dir / "run_summary.json", json.dumps(summary, indent=2))
        if self._wandb is not None:
            self._wandb.finish()
        self._drop_replaced()
        self.release()

    def release(self) -> None:
        """Let the next process in (the OS lets go by itself if this one dies)."""
        self._lock.release()

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step_{step:07d}"

    @contextmanager
    def writing_checkpoint(self, step: int):
        """Write into a temp dir, then rename: a kill leaves either the old or the new checkpoint."""
        final = self.checkpoint_path(step)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        identity = {"experiment_sha256": self.recipe.experiment_sha256(), "seed": self.recipe.run.seed,
                    "stage": self.stage, "step": step}
        write_manifest(tmp, identity)  # last: a checkpoint without one never finished
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(self.ckpt_dir / "latest", final.name)
        self._drop_replaced()  # the new run has a checkpoint: the one it replaces can go
        self._prune()

    def _prune(self) -> None:
        for old in self._checkpoints()[self.recipe.run.keep_checkpoints:]:
            shutil.rmtree(old, ignore_errors=True)

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint this run resumes from (chosen and verified when it started), or None."""
        return self.resume_from

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "final"


def adopting() -> bool:
    """`--adopt-checkpoint` was given (also seen by the ranks torchrun starts: it is an environment variable)."""
    return os.environ.get(ADOPT_ENV) == "1"


def refuse_or_warn(problem: str) -> None:
    """A checkpoint that is not this run's: refused, or (--adopt-checkpoint) resumed with a warning."""
    if adopting():
        console.print(f"[yellow]{problem}; resuming from it anyway (--adopt-checkpoint)[/]", highlight=False,
                      soft_wrap=True)
        return
    raise UserError(f"{problem}; not resuming from it: --adopt-checkpoint to resume from it deliberately, or "
                    "--overwrite to start over")


def check_resume_step(ckpt: Path, step: int) -> None:
    """The step a loaded checkpoint's state says (progress.json, the trainer's step count) must be the
    one its manifest records: an edited or mixed-up file would skip or repeat steps."""
    ident = read_identity(ckpt)
    if ident is not None and ident.get("step") != step:
        refuse_or_warn(f"{ckpt}: its state is at step {step}, but its manifest records step {ident.get('step')}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def _make_dir(path: Path, field: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"{field}: cannot write run records in {path}: {err.strerror or err}") from None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf}: nested mappings by dotted key; lists and other values are leaves."""
    if not isinstance(tree, dict):
        raise AttributeError("not a mapping")
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


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
