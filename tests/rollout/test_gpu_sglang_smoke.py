"""Real SGLang on a GPU: scripts/gpu_smoke_sglang.py as a test (`make gpu-smoke`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _model_or_skip() -> str:
    model = os.environ.get("RLRECIPE_SGLANG_SMOKE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    if Path(model).is_dir():
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1")
    except Exception as err:  # noqa: BLE001 - any failure to find weights means: skip
        pytest.skip(f"model {model} not available ({type(err).__name__}); set RLRECIPE_SGLANG_SMOKE_MODEL")


def test_real_sglang_logprobs_budget_and_weight_update(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make install-gpu)")
    model = _model_or_skip()
    port = free_port()
    spec = importlib.util.spec_from_file_location("gpu_smoke_sglang", REPO / "scripts" / "gpu_smoke_sglang.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    res = smoke.main(["--model", model, "--port", str(port), "--run-dir", str(tmp_path), "--samples", "2",
                      "--max-new-tokens", "128"])
    assert not res["failures"], res
    assert res["mean_abs_dlogp"] < 0.05 and res["budget_partial"] > 0 and res["resumed_all_done"]
