"""Two runs started together on one machine with the same rollout.sglang.base_port: one trains, the
other stops in one line naming the process that holds the port, and neither run's server hears from
the other run (rlrecipe/rollout/sglang/ownership.py).

The race is made certain rather than left to timing: the losing run starts first and its server binds
late (a delay before `rlrecipe serve`, or the real SGLang's own load), so both runs found the port free,
and the winner's server binds in between, as in the report that two runs crossed over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import rl_recipe, write_recipe, write_tiny_data
from tests.rollout.test_sglang_client import free_port

RL = [sys.executable, "-m", "rlrecipe.cli.app", "rl"]
STANDIN = ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}",
           "--access-log"]


def delayed(seconds: float, cmd: list[str]) -> list[str]:
    """`cmd` started after a pause: a server that binds its port late."""
    return ["bash", "-c", f'sleep {seconds}; exec "$0" "$@"', *cmd]


def standin_cmd() -> list[str]:
    return [sys.executable, "-m", "rlrecipe.cli.app", *STANDIN[1:]]


def _recipe(root: Path, data: Path, model: Path, port: int, launch_cmd: list[str]) -> Path:
    spec = rl_recipe(root, data, str(model), steps=2, c3po={"enabled": False})
    spec["eval"]["benchmarks"] = []
    spec["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 40, "sglang": {
        "base_port": port, "startup_timeout_s": 240, "launch_cmd": launch_cmd}}
    root.mkdir(parents=True, exist_ok=True)
    return write_recipe(root / "rl.yaml", spec)


def _access_lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ' HTTP/1.1" ' in ln]


def race(tmp_path: Path, model: Path, loser_cmd: list[str]) -> int:
    """The losing run (its server `loser_cmd`) first, the winner (`rlrecipe serve` at once) once the
    loser's server is launched, on one port, which it returns. Asserts the winner trained, the loser
    refused, and who spoke to whom."""
    data = write_tiny_data(tmp_path / "data")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SGLANG_API_KEY", None)  # each run draws its own key, as a user's runs do
    lose_run, win_run = tmp_path / "lose" / "runs" / "rl", tmp_path / "win" / "runs" / "rl"
    loser = subprocess.Popen([*RL, str(_recipe(tmp_path / "lose", data, model, port, loser_cmd))], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    winner = None
    try:
        deadline = time.monotonic() + 240
        while not (lose_run / "sglang_server_0.log").exists():  # both runs found the port free
            assert loser.poll() is None and time.monotonic() < deadline, loser.stdout.read()[-3000:]
            time.sleep(0.1)
        winner = subprocess.Popen([*RL, str(_recipe(tmp_path / "win", data, model, port, standin_cmd()))],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lost = loser.communicate(timeout=600)[0]
        won = winner.communicate(timeout=600)[0]
    finally:
        for proc in (loser, winner):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert winner.returncode == 0, won[-3000:]
    assert loser.returncode != 0, lost[-3000:]
    rows = [json.loads(ln) for ln in (win_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]

    refusal = [ln for ln in lost.splitlines() if f"port {port} on 127.0.0.1 is held by another process" in ln]
    assert len(refusal) == 1, lost[-3000:]
    assert "rlrecipe.cli.app serve" in refusal[0] and "not by the server this run launched" in refusal[0]
    assert "set rollout.sglang.base_port" in refusal[0]
    # the winner's server heard its own run only, but for the loser's health probe where the winner
    # bound between the loser's port check and that probe (it carries no key); the loser's never
    # bound, so it heard no one
    heard = _access_lines(win_run / "sglang_server_0.log")
    assert any(f"rlrecipe pid/{winner.pid}" in ln and "/generate" in ln for ln in heard)
    assert all("GET /health_generate " in ln for ln in heard if f"pid/{loser.pid}" in ln)
    # refused once: the winner's own proof, asked without its key (ownership.key_proof)
    refused = [ln for ln in heard if '" 401 ' in ln]
    assert len(refused) == 1 and "GET /rlrecipe_ownership_proof" in refused[0] and f"pid/{winner.pid}" in refused[0]
    assert not _access_lines(lose_run / "sglang_server_0.log")
    return port


@pytest.mark.slow
def test_two_runs_on_one_port_one_trains_and_the_other_refuses(tmp_path, tiny_model_dir):
    race(tmp_path, tiny_model_dir, delayed(45, standin_cmd()))
