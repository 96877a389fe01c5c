"""make gpu-quick's runner (bench/gpu/quick.py) on this CPU: its JSON, the deadline and budgets, a failing
part recorded and the next one run, a signal mid-part, and every part's dry run (toy sizes, no GPU)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu.quick import PARTS, SCHEMA, decode_points

REPO = Path(__file__).resolve().parents[2]


def _quick(out: Path, *args: str, timeout: float = 600) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.quick", "--cpu-dry-run", "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_a_failing_part_is_recorded_and_the_next_runs_a_part_past_its_budget_is_killed_and_one_that_does_not_fit_skipped(
        tmp_path):
    doc = _quick(tmp_path / "q.json", "--parts", "env,ipc_push,decode_bf16,decode_fp8_e4m3", "--fail", "ipc_push",
                 "--budget", "env=0.05", "--budget", "decode_fp8_e4m3=1000", "--deadline-s", "300")
    assert doc["schema"] == SCHEMA and doc["cpu_dry_run"] and doc["finished"]
    assert doc["order"] == ["env", "ipc_push", "decode_bf16", "decode_fp8_e4m3"]
    env, ipc, bf16, fp8 = (doc["parts"][n] for n in doc["order"])
    assert env["status"] == "timeout" and "budget" in env["error"]  # killed at 0.05 s, the run went on
    assert ipc["status"] == "error" and "fails on purpose" in ipc["error"] and "RuntimeError" in ipc["traceback"]
    assert bf16["status"] == "ok" and bf16["budget_s"] == 120
    assert fp8["status"] == "skipped" and "exceeds" in fp8["reason"] and "result" not in fp8
    # the bf16 arm's decoding points, hoisted where a projection reads them
    points = decode_points(tmp_path / "q.json")
    assert [p["batch"] for p in points] == [2, 4] and {p["kv_cache_dtype"] for p in points} == {"auto"}
    for p in points:
        assert p["generated_tokens"] == p["batch"] * p["new_tokens"]  # no row ended early
        assert p["decode_tokens_s"] == pytest.approx(p["batch"] / p["step_s"])
        assert p["predicted_step_s_h100_rates"] > 0 and p["peak_allocated_bytes"] is None
    assert (tmp_path / "quick_logs" / "decode_bf16.log").exists()


def test_a_tiny_deadline_skips_every_part_and_still_writes_the_json(tmp_path):
    doc = _quick(tmp_path / "q.json", "--deadline-s", "1", timeout=60)
    assert doc["order"] == [name for name, *_ in PARTS]
    assert {p["status"] for p in doc["parts"].values()} == {"skipped"}
    assert doc["decode_points"] == [] and doc["setup"]["installed"] is False


def test_a_signal_mid_part_leaves_the_json_with_what_was_running(tmp_path):
    out = tmp_path / "q.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu.quick", "--cpu-dry-run", "--out", str(out),
                             "--parts", "decode_bf16"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        if out.exists() and json.loads(out.read_text())["parts"].get("decode_bf16", {}).get("status") == "running":
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    doc = json.loads(out.read_text())
    assert doc["parts"]["decode_bf16"]["status"] == "interrupted" and "signal" in doc["interrupted"]
    assert doc["finished"] is None


def test_unknown_parts_are_refused():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.quick", "--parts", "env,nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope" in proc.stderr


@pytest.mark.slow
def test_every_part_runs_as_a_cpu_dry_run(tmp_path):
    doc = _quick(tmp_path / "q.json", timeout=1800)
    assert {n: p["status"] for n, p in doc["parts"].items()} == {name: "ok" for name, *_ in PARTS}, doc["parts"]
    r = {n: p["result"] for n, p in doc["parts"].items()}
    for stage in (3, 2):
        plan = r[f"plan_zero{stage}"]
        assert plan["zero_stage"] == stage and plan["predicted_mib"] > 0 and plan["measured_mib"] > 0
    assert r["colocated_torch"]["engine"] == "torch" and r["colocated_deepspeed"]["zero_stage"] == 3
    for part in ("colocated_torch", "colocated_deepspeed"):
        assert set(r[part]["seconds"]) >= {"offload_optimizer", "offload_weights", "reload"}
        assert r[part]["loss_finite"]
    assert r["ipc_push"]["served_bit_for_bit"] and r["ipc_push"]["cpu_copy_bit_for_bit"]
    assert r["handover_test"]["outcome"] == "skipped"  # it needs CUDA
    assert {p["kv_cache_dtype"] for p in doc["decode_points"]} == {"auto", "fp8_e4m3"}
