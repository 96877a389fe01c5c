"""Two runs on one base_port, the losing one launching the released SGLang: it stops in one line, its
SGLang is stopped whole, and the winner (`rlrecipe serve`) trains without hearing from it."""

from __future__ import annotations

import subprocess

from tests.live.conftest import SERVE, SERVER_ARGS, require_sglang
from tests.rl.test_runs_sharing_a_port import delayed, race


def test_a_run_launching_sglang_on_a_port_another_run_took_refuses(tmp_path, demo_model_dir):
    require_sglang()
    sglang = [str(SERVE), "{model}", "{host}", "{port}", "{dtype}", "{seed}", *SERVER_ARGS]
    port = race(tmp_path, demo_model_dir, delayed(5, sglang))
    # nothing of the losing run's SGLang is left (launcher, scheduler, detokenizer)
    left = subprocess.run(["pgrep", "-f", f"sglang.launch_server.*--port {port} "], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
