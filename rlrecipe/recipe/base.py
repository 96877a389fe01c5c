"""The base of every recipe section: unknown keys refused, no booleans for numbers, bounded integers.

Also the error a recipe mistake raises, and the marker a field added after recipes were published
carries so that those recipes keep their sha256 (recipe.py applies it).
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from rlrecipe.core.errors import UserError


class RecipeError(UserError):
    """A user mistake in a recipe: printed as one line, exit code 2."""


def _is_number_field(annotation: Any) -> bool:
    args = set(get_args(annotation)) or {annotation}
    return bool(args & {int, float}) and bool not in args


# No count, size or step in a recipe comes near this; a bigger integer is a typo (`rl.steps: 1e30`
# read as a number) that would only fail, or silently overflow, deep inside a stage.
MAX_INT = 2**31 - 1


def _too_big(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > MAX_INT
    if isinstance(value, (list, tuple)):
        return any(_too_big(v) for v in value)
    if isinstance(value, dict):
        return any(_too_big(v) for v in value.values())
    return False


# A field added to the schema after recipes were published enters the sha256 only when set to
# something other than its default: the recipes that never set it keep their sha256.
HASHED_WHEN_SET = {"hashed_when_set": True}


class Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `reward_correct: .nan` in any float field is refused here,
    # not found as NaN weights after a run that exited 0
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field; `rl.steps: true` is a typo, not one step
        if isinstance(value, bool) and _is_number_field(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not true/false")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_ints(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name != "seed" and _too_big(value):
            raise ValueError(f"integers in a recipe are at most {MAX_INT} (2**31 - 1)")
        return value
