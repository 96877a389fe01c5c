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


def test_a_launched_stage_exits_with_its_failed_ranks_own_status(tmp_path):
    """torchrun exits 1 whatever its ranks did; the stage passes on the status its failed ranks agree
    on, so a cluster job tells a mistake in the recipe (2, not run again) from a resumable stop (75)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nfrom rlrecipe.train.launch import end_process\n"
                      "end_process(int(sys.argv[1]) if os.environ['RANK'] == '0' else int(sys.argv[2]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    from rlrecipe.train.launch import STATUS_DIR_ENV, ranks_status

    # torchrun stops the other ranks once one fails, so a rank's own status may never be left: the
    # statuses left are those of the ranks that ended themselves
    for rank0, rank1, torchrun_rc, status in ((2, 0, 1, 2), (75, 75, 1, 75), (0, 0, 0, 0)):
        folder = tmp_path / f"status-{rank0}-{rank1}"
        folder.mkdir()
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                               "--nproc_per_node=2", str(script), str(rank0), str(rank1)], cwd=REPO, timeout=120,
                              env={**env, STATUS_DIR_ENV: str(folder)}, capture_output=True, text=True)
        assert done.returncode == torchrun_rc, done.stderr[-2000:]
        assert ranks_status(done.returncode, folder) == status
    disagree = tmp_path / "disagree"  # ranks that failed each their own way: torchrun's word stands
    disagree.mkdir()
    (disagree / "rank0").write_text("2")
    (disagree / "rank1").write_text("75")
    assert ranks_status(1, disagree) == 1
