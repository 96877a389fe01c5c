"""The prompts an RL run draws, in a seeded order per epoch, each sampled n times as a group."""

from __future__ import annotations

import random

from rlrecipe.core.errors import UserError
from rlrecipe.core.seeds import PROMPT_EPOCH, mix_seed
from rlrecipe.data.templates import row_prompt_ids
from rlrecipe.trajectory.record import Trajectory


class PromptStream:
    """Endless, seeded, epoch-shuffled stream of RL prompts; its cursor is checkpointed."""

    def __init__(self, rows: list[dict], tokenizer, template: str, seed: int, shuffle: bool = True,
                 max_prompt_tokens: int | None = None):
        """A prompt longer than `max_prompt_tokens` (after the template) is left out and counted in
        `skipped_too_long`, as AReaL filters its RL set by prompt length when loading it."""
        self.tokenizer, self.template = tokenizer, template
        self.rows, self.skipped_too_long = rows, 0
        if max_prompt_tokens is not None:
            self.rows = [r for r in rows if len(row_prompt_ids(tokenizer, r, template)) <= max_prompt_tokens]
            self.skipped_too_long = len(rows) - len(self.rows)
            if rows and not self.rows:
                raise UserError(f"data.max_prompt_tokens: all {len(rows)} prompts are longer than "
                                f"{max_prompt_tokens} tokens")
        self.seed, self.shuffle = seed, shuffle
        self.cursor = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(mix_seed(self.seed, epoch, PROMPT_EPOCH)).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next_group(self, n: int) -> list[Trajectory]:
        epoch, i = divmod(self.cursor, len(self.rows))
        row = self.rows[self._epoch_order(epoch)[i]]
        self.cursor += 1
        prompt = row_prompt_ids(self.tokenizer, row, self.template)
        gid = f"{row['id']}@{self.cursor - 1}"
        return [Trajectory(uid=f"{gid}#{j}", prompt_ids=prompt, group_id=gid, answers=list(row["answers"]))
                for j in range(n)]
