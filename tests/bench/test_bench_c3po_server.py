"""The C3PO++ vs synchronous benchmark against an SGLang-API server (here `rlrecipe serve`)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers import write_tiny_data
from tests.ports import free_port

pytestmark = pytest.mark.slow  # subprocess-heavy: `make test-fast` leaves it out


def test_c3po_bench_runs_against_a_server(tmp_path, tiny_model_dir):
    port = free_port()
    data = write_tiny_data(tmp_path / "data")
    out = tmp_path / "c3po.json"
    serve = f"{sys.executable} -m rlrecipe.cli.app serve {{model}} --host {{host}} --port {{port}} --dtype {{dtype}}"
    subprocess.run([sys.executable, "-m", "bench.c3po_compare", "--model", str(tiny_model_dir), "--prompts",
                    str(data / "rl.jsonl"), "--template", "plain", "--launch-cmd", serve, "--dtype", "float32",
                    "--port", str(port), "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                    "--max-new-tokens", "24", "--out", str(out)], cwd=REPO, check=True, timeout=300,
                   capture_output=True)
    result = json.loads(out.read_text())
    # C3PO++ collects until the budget (what a synchronous step trained) is reached
    assert result["tokens_per_step_c3po"] >= result["token_budget"] > 0 and result["tokens_per_step_sync"] > 0
    assert result["rollout_speedup_per_trained_token"] > 0 and result["sync_rollout_s_per_step"] > 0
    assert "forward_pass_ratio_per_trained_token" not in result  # a server does not count its passes
