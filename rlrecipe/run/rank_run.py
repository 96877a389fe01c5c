"""The run record under torchrun: rank 0 writes, the other ranks know the paths and join.

A single process gets a plain `Run`. Under several ranks every rank builds a `RankAwareRun`:
rank 0 is a normal run (directory lock, records, checkpoints, metrics); the other ranks write
nothing but take part in collective checkpoint saves, so each can put its shard into the
checkpoint directory rank 0 opened.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rlrecipe.core.dist import barrier, broadcast_from_rank_zero, is_rank_zero, world_size
from rlrecipe.recipe.schema import LoadedRecipe
from rlrecipe.run.record import Run


class RankAwareRun(Run):
    """Rank 0 is a normal Run; the others know the paths, write nothing, and join checkpoints."""

    def __init__(self, loaded: LoadedRecipe, stage: str, resume: bool = False, subdir: str | None = None,
                 overwrite: bool = False):
        if is_rank_zero():
            def start():
                super(RankAwareRun, self).__init__(loaded, stage, resume=resume, subdir=subdir, overwrite=overwrite)
                return self.resume_from

            broadcast_from_rank_zero(start)
            return
        # rank 0 made the directories and chose the checkpoint to resume from (or failed)
        self._set_paths(loaded, stage, subdir)
        self.resume_from = broadcast_from_rank_zero(lambda: None)

    def truncate_metrics(self, after_step: int) -> None:
        if is_rank_zero():
            super().truncate_metrics(after_step)

    def log(self, step, metrics, echo: bool = True, total: int | None = None) -> None:
        if is_rank_zero():
            super().log(step, metrics, echo=echo, total=total)

    def finish(self, token_columns: tuple[str, ...] = ()) -> None:
        if is_rank_zero():
            super().finish(token_columns)

    @contextmanager
    def writing_checkpoint(self, step: int):
        """Every rank writes its part into rank 0's temp dir; rank 0 renames it when all are done."""
        outer = super().writing_checkpoint(step) if is_rank_zero() else None
        tmp = broadcast_from_rank_zero(lambda: outer.__enter__())
        try:
            yield tmp
            barrier()  # all parts written
        except BaseException:
            if outer is not None:
                outer.__exit__(*sys.exc_info())
            raise
        if outer is not None:
            outer.__exit__(None, None, None)
        barrier()  # the checkpoint is in place before anyone goes on


def make_run(loaded: LoadedRecipe, stage: str, resume: bool = False, subdir: str | None = None,
             overwrite: bool = False) -> Run:
    """A `Run` for this process: the plain one in a single process; rank-aware under torchrun."""
    if world_size() == 1:
        return Run(loaded, stage, resume=resume, subdir=subdir, overwrite=overwrite)
    return RankAwareRun(loaded, stage, resume=resume, subdir=subdir, overwrite=overwrite)
