"""`--overwrite` without losing the earlier run: it is moved aside, and deleted only once the new run
has written its first checkpoint; a start that fails (or is killed) before that gets it back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlrecipe.core.console import console

REPLACED = ".replaced"
REPLACED_ITEMS = ("checkpoints", "metrics.jsonl", "run_summary.json", "final", "recipe.yaml", "recipe.sha256",
                  "env.json", "init_model", "validation", "validation_model")


class SetAside:
    """The earlier run's items in `<dir>/.replaced` while a new run starts over them."""

    def __init__(self, directory: Path, with_final: bool):
        """`with_final`: the directory is a training run's own (an eval's subdirectory has no final model)."""
        self.dir = directory
        self.items = [n for n in REPLACED_ITEMS if n != "final" or with_final]
        self.held: Path | None = None

    @staticmethod
    def exists_in(directory: Path) -> bool:
        return (directory / REPLACED).is_dir()

    def set_aside(self) -> None:
        aside = self.dir / REPLACED
        aside.mkdir()
        for name in self.items:
            if (self.dir / name).exists():
                os.replace(self.dir / name, aside / name)
        self.held = aside
        console.print(f"{self.dir}: the earlier run is kept in {aside} until this one writes its first checkpoint",
                      highlight=False, soft_wrap=True)

    def restore(self) -> None:
        """An `--overwrite` start that ended before its first checkpoint: its earlier run comes back."""
        shutil.rmtree(self.dir / (REPLACED + ".drop"), ignore_errors=True)  # a deletion a kill interrupted
        aside = self.dir / REPLACED
        if not aside.is_dir():
            return
        for name in self.items:
            _remove(self.dir / name)
            if (aside / name).exists():
                os.replace(aside / name, self.dir / name)
        shutil.rmtree(aside)
        self.held = None
        console.print(f"[yellow]{self.dir}: restored the earlier run that an --overwrite start set aside; that start "
                      "ended before its first checkpoint[/]", highlight=False, soft_wrap=True)

    def drop(self) -> None:
        """The new run has a checkpoint: the earlier one can go."""
        if self.held is None:
            return
        dropping = self.held.with_name(REPLACED + ".drop")
        os.replace(self.held, dropping)  # atomic: a kill mid-delete cannot leave half an earlier run to restore
        shutil.rmtree(dropping, ignore_errors=True)
        self.held = None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
