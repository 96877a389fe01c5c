"""Import arrows point down: data and reward never pull in run records (runs -> recipe -> data)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    assert "rlrecipe.runs" not in loaded and "rlrecipe.recipe" not in loaded


@pytest.mark.parametrize("leaf", ["rlrecipe.atomic_io", "rlrecipe.console", "rlrecipe.seeds"])
def test_leaf_modules_import_nothing_from_the_project(leaf):
    package = _project_modules_after(["rlrecipe"])  # what the package's own __init__ sets up, always loaded
    assert package <= {"rlrecipe", "rlrecipe.threads", "rlrecipe.library_notices"}
    assert _project_modules_after([leaf]) == package | {leaf}


@pytest.mark.parametrize("module", ["rlrecipe.train.launch", "rlrecipe.dist"])
def test_launch_and_ranks_do_not_reach_back_up_to_the_cli(module):
    """The CLI starts the processes and asks the ranks; neither imports the CLI, nor names its module
    (the command a relaunch runs is the CLI's own, handed down)."""
    loaded = _project_modules_after([module])
    assert module in loaded  # the probe worked
    assert not any(m == "rlrecipe.cli" or m.startswith("rlrecipe.cli.") for m in loaded)
    source = (ROOT / (module.replace("rlrecipe.", "rlrecipe/", 1).replace(".", "/") + ".py")).read_text()
    assert "rlrecipe.cli" not in source
