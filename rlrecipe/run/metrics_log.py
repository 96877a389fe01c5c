"""A run's metrics as it goes: one JSON row a step in metrics.jsonl, echoed with an ETA, mirrored to
W&B when the recipe asks; cut back to the checkpoint a resume starts from."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.recipe.systems import Tracking
from rlrecipe.run.metrics_file import metric_lines, read_metrics


class MetricsLog:
    def __init__(self, path: Path, stage: str):
        self.path = path
        self.stage = stage
        self.started = time.time()
        self._first_logged: tuple[int, float] | None = None  # (step before, time) when this session began
        self._wandb = None

    def start_wandb(self, tracking: Tracking, name: str, directory: Path, config: dict) -> None:
        os.environ.setdefault("WANDB_MODE", tracking.mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb.init(project=tracking.project, name=f"{name}-{self.stage}", dir=str(directory),
                                 config=config, resume="allow", id=f"{name}-{self.stage}")

    def truncate(self, after_step: int) -> None:
        """On resume, drop metric lines written after the checkpoint we resume from, and a line
        a kill cut short."""
        if self.path.exists():
            kept = [ln for ln, row in metric_lines(self.path) if row.get("step", 0) <= after_step]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True, total: int | None = None) -> None:
        """Append one metrics row; with `echo`, print it, and with `total` the steps left and an ETA."""
        row = {"step": step, "stage": self.stage, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._first_logged is None:
            self._first_logged = (step - 1, self.started)
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

    def totals(self, columns: tuple[str, ...]) -> dict[str, float]:
        """`<column>_total` summed over the rows kept."""
        totals = {f"{c}_total": 0 for c in columns}
        for row in read_metrics(self.path):
            for c in columns:
                totals[f"{c}_total"] += row.get(c, 0)
        return totals

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
