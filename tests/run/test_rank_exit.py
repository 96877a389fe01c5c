"""How a rank of a multi-process run leaves: exit handlers run, output flushed, its status kept,
and no interpreter teardown (where a rank can abort after its work is done)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RANK_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}

LEAVER = r"""
import atexit, sys
from rlrecipe.train.launch import end_process
atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
class Finalizer:
    def __del__(self):  # runs in the interpreter's teardown only
        open(sys.argv[2], "w").write("torn down")
keep = Finalizer()
sys.stdout.write("buffered, no newline")
end_process(int(sys.argv[3]) if sys.argv[3].isdigit() else sys.argv[3])
"""


def _leave(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LEAVER, str(tmp_path / "atexit"), str(tmp_path / "teardown"), code],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_end_process_runs_exit_handlers_flushes_and_skips_teardown(tmp_path):
    out = _leave(tmp_path, "3")
    assert out.returncode == 3, out.stderr
    assert out.stdout == "buffered, no newline"
    assert (tmp_path / "atexit").read_text() == "exit handlers ran"
    assert not (tmp_path / "teardown").exists()


def test_end_process_with_a_message_prints_it_and_fails(tmp_path):
    out = _leave(tmp_path, "stopped: bad thing")
    assert out.returncode == 1 and out.stderr.strip() == "stopped: bad thing"


def test_a_launched_rank_keeps_the_commands_status_and_message():
    """The CLI's own exits on a rank of two: a user error (2, its one line) and success (0)."""
    env = {**os.environ, **RANK_ENV, "RLRECIPE_LAUNCHED": "1"}
    bad = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "plan", "no/such/recipe.yaml"], capture_output=True,
                         text=True, cwd=REPO, timeout=120, env=env)
    assert bad.returncode == 2 and "no/such/recipe.yaml" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "plan", "recipes/tiny_rl.yaml"], capture_output=True,
                        text=True, cwd=REPO, timeout=120, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "fits" in ok.stdout + ok.stderr
