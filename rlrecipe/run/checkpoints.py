"""A run's checkpoints: written atomically with a manifest, chosen on resume only if complete and the
run's own (same experiment, seed, stage and step), pruned to the recipe's `run.keep_checkpoints`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.run.manifest import check_manifest, read_identity, write_manifest

# Resuming from a checkpoint another experiment (or seed, or stage) wrote, or whose state disagrees
# with the step its manifest records, is refused unless this is set (`--adopt-checkpoint`).
ADOPT_ENV = "RLRECIPE_ADOPT_CHECKPOINT"


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint records of the run that wrote it."""

    experiment_sha256: str
    seed: int
    stage: str

    def at(self, step: int) -> dict:
        return {"experiment_sha256": self.experiment_sha256, "seed": self.seed, "stage": self.stage, "step": step}


class Checkpoints:
    """`<run>/checkpoints/step_NNNNNNN/`, the newest named by `latest`."""

    def __init__(self, directory: Path, identity: RunIdentity, keep: int):
        self.dir = directory
        self.identity = identity
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:07d}"

    def newest_first(self) -> list[Path]:
        """Checkpoint directories by step, newest first (unfinished `.partial` ones left out)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if p.is_dir() and step_of(p) is not None]
        return sorted(found, key=step_of, reverse=True)

    def pick(self, experiments: set[str]) -> Path | None:
        """The newest checkpoint that is complete and this run's (written under one of `experiments`);
        says which, and why newer ones were passed over."""
        ckpts = self.newest_first()
        marker = self.dir / "latest"
        named = marker.read_text().strip() if marker.is_file() else None
        if named and not (self.dir / named).is_dir():
            console.print(f"[yellow]{marker} names {named}, which is missing[/]", highlight=False, soft_wrap=True)
        if not ckpts:
            console.print(f"no checkpoint in {self.dir}: starting from step 0", highlight=False, soft_wrap=True)
            return None
        for path in ckpts:
            problem = check_manifest(path)
            if problem is None:
                self._check_identity(path, experiments)
                if path.name != named or path != ckpts[0]:
                    console.print(f"[yellow]resuming from {path.name}, the newest complete checkpoint[/]",
                                  highlight=False, soft_wrap=True)
                return path
            console.print(f"[yellow]{path}: damaged or incomplete ({problem}); not resuming from it[/]",
                          highlight=False, soft_wrap=True)
        raise UserError(f"{self.dir}: none of the {len(ckpts)} checkpoints is complete; --overwrite to "
                        "start over")

    def _check_identity(self, path: Path, experiments: set[str]) -> None:
        """A checkpoint resumes only the run that wrote it: same experiment, seed and stage, and the
        step its manifest records is the one its name says."""
        ident = read_identity(path)
        if ident is None:
            refuse_or_warn(f"{path}: its manifest does not record the run that wrote it (experiment, seed, stage, "
                           "step), so nothing shows it is this run's")
            return
        own = self.identity
        problems = []
        if ident.get("experiment_sha256") not in experiments:
            problems.append(f"written by another experiment (sha256 {str(ident.get('experiment_sha256'))[:12]}, "
                            f"this recipe's is {own.experiment_sha256[:12]})")
        if ident.get("seed") != own.seed:
            problems.append(f"written with run.seed {ident.get('seed')}, this recipe's is {own.seed}")
        if ident.get("stage") != own.stage:
            problems.append(f"written by the {ident.get('stage')!r} stage")
        if ident.get("step") != step_of(path):
            problems.append(f"its manifest records step {ident.get('step')}")
        if problems:
            refuse_or_warn(f"{path}: {'; '.join(problems)}")

    @contextmanager
    def writing(self, step: int, on_written: Callable[[], None]):
        """Write into a temp dir, then rename: a kill leaves either the old or the new checkpoint.
        `on_written` runs once the new one is in place, before older ones are pruned."""
        final = self.path(step)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        write_manifest(tmp, self.identity.at(step))  # last: a checkpoint without one never finished
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(self.dir / "latest", final.name)
        on_written()
        for old in self.newest_first()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)


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


def step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None
