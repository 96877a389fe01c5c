"""A resume under another recipe sha256 than the run started with: the same experiment or refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlrecipe.core.console import console
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import LoadedRecipe, _digest, recipe_from_dict

# Where a job's processes meet and which servers it talks to: a resubmitted job gets other hosts.
MOVES_BETWEEN_JOBS = ("trainer.master_addr", "trainer.master_port", "rollout.urls")


def check_same_experiment(directory: Path, loaded: LoadedRecipe) -> None:
    """Refused, naming the fields that differ, unless the only difference is fields the schema gained
    since, at their defaults (a newer rlrecipe reading the same recipe: its sha256 covers every
    default). Then said, and the run goes on under the new sha256."""
    refuse = f"{loaded.path}: recipe differs from the one {directory} was started with"
    try:
        was = _flat(yaml.safe_load((directory / "recipe.yaml").read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, AttributeError):
        raise RecipeError(f"{refuse}; resume with the same recipe or choose another run.name") from None
    now = _flat(loaded.recipe.model_dump(mode="json"))
    explicit = _flat(loaded.recipe.model_dump(mode="json", exclude_defaults=True))
    moved = sorted(k for k in MOVES_BETWEEN_JOBS if k in was and k in now and was[k] != now[k])
    changed = sorted(k for k in was.keys() & now.keys() if was[k] != now[k] and k not in MOVES_BETWEEN_JOBS)
    gone = sorted(was.keys() - now.keys())
    added = sorted(now.keys() - was.keys())
    set_new = [k for k in added if k in explicit]
    if changed or gone or set_new:
        parts = [f"{k}: {was[k]!r} -> {now[k]!r}" for k in changed] + [f"{k} no longer exists" for k in gone]
        parts += [f"{k}: new, set to {now[k]!r}" for k in set_new]
        shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
        raise RecipeError(f"{refuse} ({shown}); resume with the same recipe or choose another run.name")
    if moved:  # a resubmitted cluster job lands on other hosts: where, not what, it computes
        console.print(f"{directory}: resuming with {', '.join(moved)} changed (this job's hosts)", highlight=False,
                      soft_wrap=True)
    if not added:
        return
    console.print(f"{directory}: resuming with {len(added)} field(s) added to the recipe schema since it started, "
                  f"at their defaults: {', '.join(added)}", highlight=False, soft_wrap=True)


def recorded_experiment(directory: Path) -> str | None:
    """The experiment sha256 of the recipe.yaml the run was started with (as Recipe.experiment_sha256)."""
    try:
        d = yaml.safe_load((directory / "recipe.yaml").read_text(encoding="utf-8"))
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


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf}: nested mappings by dotted key; lists and other values are leaves."""
    if not isinstance(tree, dict):
        raise AttributeError("not a mapping")
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out
