"""Run records: the run directory, environment capture, metrics, atomic checkpoints."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from rlrecipe.recipe import LoadedRecipe

console = Console(stderr=True)

KEY_PACKAGES = ["torch", "transformers", "tokenizers", "datasets", "math-verify", "deepspeed", "pydantic", "sglang"]


def git_state(cwd: str | Path | None = None) -> dict[str, Any]:
    cwd = str(cwd or Path(__file__).resolve().parent.parent)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd, capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": dirty}


def environment() -> dict[str, Any]:
    versions = {}
    for name in KEY_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - environment capture must never fail a run
        pass
    return {
        **git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "packages": versions,
    }


def record_model(run_dir: Path, record: dict[str, Any]) -> None:
    """Add the resolved starting model (snapshot commit, chat template sha256) to env.json."""
    path = Path(run_dir) / "env.json"
    if not path.exists():
        return
    env = json.loads(path.read_text())
    env["model"] = record
    atomic_write_text(path, json.dumps(env, indent=2))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Run:
    """`runs/<name>/`: the resolved recipe, its sha256, environment, metrics, checkpoints."""

    def __init__(self, loaded: LoadedRecipe, stage: str, resume: bool = False, subdir: str | None = None):
        """`subdir` keeps a later stage's records (eval) beside, not over, the training run's."""
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.stage = stage
        self.run_dir = self.recipe.run.dir
        self.dir = self.run_dir / subdir if subdir else self.run_dir
        self.ckpt_dir = self.dir / "checkpoints"
        if not resume:
            # a fresh start must not mix with an earlier run of the same name
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
            (self.dir / "metrics.jsonl").unlink(missing_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(exist_ok=True)
        recorded = self.dir / "recipe.sha256"
        if resume and recorded.exists() and recorded.read_text().split()[0] != loaded.sha256:
            from rlrecipe.recipe import RecipeError

            raise RecipeError(
                f"{loaded.path}: recipe differs from the one {self.dir} was started with; "
                "resume with the same recipe or choose another run.name"
            )
        atomic_write_text(self.dir / "recipe.yaml", self.recipe.to_yaml())
        atomic_write_text(recorded, f"{loaded.sha256}  {loaded.path}\n")
        meta = {"stage": stage, "recipe_path": loaded.path, "recipe_sha256": loaded.sha256,
                "overrides": loaded.overrides, "seed": self.recipe.run.seed, "started": time.time(),
                **environment()}
        atomic_write_text(self.dir / "env.json", json.dumps(meta, indent=2))
        self._num_gpus = len(meta["gpus"])
        self.metrics_path = self.dir / "metrics.jsonl"
        self._started = time.time()
        self._wandb = None
        if self.recipe.run.tracking.wandb:
            self._start_wandb()

    def _start_wandb(self) -> None:
        tr = self.recipe.run.tracking
        os.environ.setdefault("WANDB_MODE", tr.mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb.init(project=tr.project, name=f"{self.recipe.run.name}-{self.stage}",
                                 dir=str(self.dir), config=self.recipe.model_dump(mode="json"),
                                 resume="allow", id=f"{self.recipe.run.name}-{self.stage}")

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop metric lines written after the checkpoint we resume from."""
        if not self.metrics_path.exists():
            return
        kept = [ln for ln in self.metrics_path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= after_step]
        atomic_write_text(self.metrics_path, "".join(ln + "\n" for ln in kept))

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        row = {"step": step, "stage": self.stage, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if echo:
            shown = "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if not isinstance(v, (list, dict)))
            console.print(f"[bold]{self.stage}[/] step {step}: {shown}", highlight=False)

    def finish(self, token_columns: tuple[str, ...] = ()) -> None:
        """Write run_summary.json: the cost of the run (GPU-hours, tokens) for RESULTS.md and notes."""
        totals = {f"{c}_total": 0 for c in token_columns}
        if self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                row = json.loads(line)
                for c in token_columns:
                    totals[f"{c}_total"] += row.get(c, 0)
        wall = time.time() - self._started
        summary = {"stage": self.stage, "wall_time_s_this_session": round(wall, 1), "gpus": self._num_gpus,
                   "gpu_hours_this_session": round(self._num_gpus * wall / 3600, 3), **totals}
        atomic_write_text(self.dir / "run_summary.json", json.dumps(summary, indent=2))
        if self._wandb is not None:
            self._wandb.finish()

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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(self.ckpt_dir / "latest", final.name)
        self._prune()

    def _prune(self) -> None:
        keep = self.recipe.run.keep_checkpoints
        done = sorted(p for p in self.ckpt_dir.glob("step_*") if not p.name.endswith(".partial"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest_checkpoint(self) -> Path | None:
        marker = self.ckpt_dir / "latest"
        if not marker.exists():
            return None
        path = self.ckpt_dir / marker.read_text().strip()
        return path if path.exists() else None

    @property
    def final_model_dir(self) -> Path:
        return self.run_dir / "final"


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
