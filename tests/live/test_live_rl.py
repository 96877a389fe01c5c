"""`rlrecipe rl` and its evaluation on the released SGLang: the recipe's launch_cmd starting the real
server (disk sync, C3PO++), and a run attached to one (weights broadcast over gloo, checked by the
probe at a temperature other than 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import requests

from tests.helpers import rl_recipe, write_recipe, write_tiny_data
from tests.live.conftest import SERVE, SERVER_ARGS, Front, free_port, require_sglang


def _rl(recipe_path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rl", str(recipe_path)], capture_output=True,
                         text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rl_launches_sglang_trains_with_disk_sync_and_c3po_and_evaluates(tmp_path, demo_model_dir):
    require_sglang()
    data = write_tiny_data(tmp_path / "data")
    recipe = rl_recipe(tmp_path, data, str(demo_model_dir), steps=3)
    # responses of up to 150 tokens against a budget of 300 a step: the budget is spent while every
    # request is still decoding, so the aborts land mid-flight however fast the server is
    recipe["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 150, "max_batch": 24, "sglang": {
        "base_port": free_port(), "startup_timeout_s": 240,
        "launch_cmd": [str(SERVE), "{model}", "{host}", "{port}", "{dtype}", "{seed}", *SERVER_ARGS]}}
    out = _rl(write_recipe(tmp_path / "rl.yaml", recipe))
    run = tmp_path / "runs" / "rl"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1 samples from the weights the trainer starts with, in float32 on both sides
    assert rows[0]["mismatch_abs_logp"] < 1e-4
    assert rows[-1]["resumed_total"] > 0  # C3PO++ cut rollouts mid-flight and resumed them under new weights
    assert all(r["weight_check_s"] > 0 and r["rollout_servers_live"] == 1 for r in rows)
    assert "cannot be verified" not in out.stdout + out.stderr
    log = (run / "sglang_server_0.log").read_text()
    assert log.count("POST /update_weights_from_disk HTTP/1.1\" 200") == 3  # steps 1..3 pushed
    assert "POST /weights_checker HTTP/1.1\" 200" in log and "POST /abort_request" in log
    # the run's server proved itself: refused without the key the run drew for it, let in with it
    assert "GET /rlrecipe_ownership_proof HTTP/1.1\" 401" in log
    assert "GET /rlrecipe_ownership_proof HTTP/1.1\" 404" in log
    summary = json.loads((run / "eval" / "tiny" / "summary.json").read_text())
    assert summary["n"] == 2 and summary["num_problems"] == 8


def test_rl_attached_to_sglang_broadcasts_weights_checked_by_the_probe(tmp_path, sglang_server, demo_model_dir):
    """/weights_checker hidden by a front: every push is decided by the probe's log-probs, scored at
    temperature 1 on both sides while the rollout samples at 0.7."""
    data = write_tiny_data(tmp_path / "data")
    front = Front(sglang_server.url, hide=("/weights_checker",))
    try:
        recipe = rl_recipe(tmp_path, data, str(demo_model_dir), steps=3, c3po={"enabled": False})
        recipe["eval"]["benchmarks"] = []
        recipe["rollout"] = {"engine": "sglang", "dtype": "float32", "temperature": 0.7, "max_new_tokens": 40,
                             "urls": [front.url], "sglang": {
                                 "weight_sync": "distributed", "weight_sync_backend": "gloo",
                                 "weight_sync_port": free_port()}}
        out = _rl(write_recipe(tmp_path / "rl.yaml", recipe))
    finally:
        front.close()
        r = requests.post(sglang_server.url + "/update_weights_from_disk",
                          json={"model_path": str(demo_model_dir), "weight_version": "default"}, timeout=120)
        assert r.status_code == 200 and r.json()["success"], r.text
    rows = _rows(tmp_path / "runs" / "rl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # each step samples from the weights the trainer had at its start: the broadcast landed, and
    # the tempered output log-probs are the trainer's
    assert all(r["mismatch_abs_logp"] < 1e-4 for r in rows), [r["mismatch_abs_logp"] for r in rows]
    # at start nothing is there to tell weights apart by (said once); after each push the probe
    # decided, or a line would say it could not
    unverified = [line for line in (out.stdout + out.stderr).splitlines() if "cannot be verified" in line]
    assert len(unverified) == 1 and "at start" in unverified[0], unverified
    log = sglang_server.log.read_text()
    assert log.count("POST /update_weights_from_distributed HTTP/1.1\" 200") >= 3
    assert log.count("POST /begin_weight_update HTTP/1.1\" 200") >= 3
