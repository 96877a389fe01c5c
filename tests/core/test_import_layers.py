"""Import arrows point down: data and reward never pull in run records (runs -> recipe -> data)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _project_modules_after(imports: list[str]) -> set[str]:
    code = (f"import sys\nfor m in {imports!r}: __import__(m)\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('rlrecipe'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    return set(json.loads(out.stdout))


def test_data_and_reward_do_not_import_runs():
    data = [f"rlrecipe.data.{p.stem}" for p in (ROOT / "rlrecipe" / "data").glob("*.py") if p.stem != "__init__"]
    reward = [f"rlrecipe.reward.{p.stem}" for p in (ROOT / "rlrecipe" / "reward").glob("*.py")
              if p.stem != "__init__"]
    loaded = _project_modules_after(data + reward)
    assert "rlrecipe.data.download" in loaded and "rlrecipe.reward.grader" in loaded  # the probe worked
    assert not any(m.startswith(("rlrecipe.run", "rlrecipe.recipe")) for m in loaded)


@pytest.mark.parametrize("leaf", ["rlrecipe.core.atomic_io", "rlrecipe.core.console", "rlrecipe.core.seeds"])
def test_leaf_modules_import_nothing_from_the_project(leaf):
    package = _project_modules_after(["rlrecipe"])  # what the package's own __init__ sets up, always loaded
    assert package <= {"rlrecipe", "rlrecipe.core", "rlrecipe.core.threads", "rlrecipe.core.library_notices"}
    assert _project_modules_after([leaf]) == package | {leaf}


@pytest.mark.parametrize("module", ["rlrecipe.train.launch", "rlrecipe.core.dist"])
def test_launch_and_ranks_do_not_reach_back_up_to_the_cli(module):
    """The CLI starts the processes and asks the ranks; neither imports the CLI, nor names its module
    (the command a relaunch runs is the CLI's own, handed down)."""
    loaded = _project_modules_after([module])
    assert module in loaded  # the probe worked
    assert not any(m == "rlrecipe.cli" or m.startswith("rlrecipe.cli.") for m in loaded)
    source = (ROOT / (module.replace("rlrecipe.", "rlrecipe/", 1).replace(".", "/") + ".py")).read_text()
    assert "rlrecipe.cli" not in source


# Packages from the bottom up; a module may import its own package and those on lower layers only.
LAYERS = [
    {"core"},
    {"trajectory", "data", "algo"},
    {"recipe", "reward"},
    {"modeling"},
    {"run", "train"},
    {"checks"},
    {"rollout"},
    {"serve", "rl", "eval"},
    {"stages", "cluster"},
    {"cli"},
]


def _package(module: str) -> str:
    """`rlrecipe.run.record` -> `run`; the top-level module `rlrecipe.modeling` is its own layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rlrecipe"


def _project_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlrecipe."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("rlrecipe.")]
    return found


def test_every_import_points_down_the_package_layers():
    layer = {pkg: i for i, group in enumerate(LAYERS) for pkg in group}
    sources = {"rlrecipe": ROOT / "rlrecipe", "cli": ROOT / "cli", "eval": ROOT / "eval"}
    upward, seen = [], set()
    for top, folder in sources.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).parts
            own = top if top != "rlrecipe" else (rel[0] if len(rel) > 1 else path.stem)
            if own == "__init__" or own == "model_configs":
                continue
            seen.add(own)
            for module in _project_imports(path):
                target = _package(module)
                if target != own and layer[target] > layer[own]:
                    upward.append(f"{path.relative_to(ROOT)} imports {module}")
    assert seen == set(layer), f"packages without a layer: {seen - set(layer)}; layers without a package: {set(layer) - seen}"
    assert not upward, "imports running back up:\n" + "\n".join(upward)
