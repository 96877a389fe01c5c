"""The parts `make gpu-quick` runs (bench/gpu/quick.py's docstring says what each measures): each a
function `part_<name>(dry) -> dict` that quick.py runs in a child process of its own, with the sizes
it runs at on a GPU and in the CPU dry run (`dry`). The runner around them (order, budgets, deadline,
the JSON) is quick.py's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: ipc_push.py and the pytest run are found from it
# hidden, intermediate, layers, heads, kv heads, vocabulary, micro-batch tokens, checkpointing (+ ZeRO stage)
PLAN_GPU = (1024, 2816, 8, 16, 4, 152064, 8192, True)
PLAN_DRY = (64, 128, 2, 4, 2, 4096, 256, True)
# the colocated hand-over's model (rlrecipe's tiny Qwen2, its character vocabulary): 2048 x 8 layers, 0.4B
HANDOVER_GPU = dict(hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=16, intermediate_size=5632,
                    max_position_embeddings=256)
HANDOVER_DRY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                    max_position_embeddings=256)
# decoding: R1-Distill-Qwen-1.5B's shapes (the one-GPU recipes' model), random bf16 weights
DECODE_GPU = dict(cfg=(1536, 8960, 28, 12, 2, 151936, 0, False), dtype="bfloat16", batches=(8, 32, 128),
                  prompt=512, new_tokens=128)
DECODE_DRY = dict(cfg=(64, 128, 2, 4, 2, 1024, 0, False), dtype="float32", batches=(2, 4), prompt=16, new_tokens=6)
IPC_GPU = ["--layers", "4", "--reps", "3"]
IPC_DRY = ["--small", "--layers", "1", "--reps", "1"]


def part_env(dry: bool) -> dict:
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "gpu_count": torch.cuda.device_count(), "gpu_memory_bytes": p.total_memory,
                "capability": f"{p.major}.{p.minor}"}
    for m in ("transformers", "deepspeed", "pydantic", "math_verify", "datasets", "sglang", "flash_attn", "pytest"):
        try:
            spec = importlib.util.find_spec(m)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            out[m] = None
            continue
        try:
            from importlib.metadata import version

            out[m] = version(m.replace("_", "-"))
        except Exception:  # noqa: BLE001 - present without metadata (a carried package on PYTHONPATH)
            out[m] = "present"
    return out


def _plan(stage: int, dry: bool) -> dict:
    from bench.plan_vs_measured_ds import run

    device = "cpu" if dry else "cuda"
    (row,) = run([(*(PLAN_DRY if dry else PLAN_GPU), stage)], device, ranks=1)
    h, inter, layers, heads, kv, vocab, *_ = PLAN_DRY if dry else PLAN_GPU
    from rlrecipe.checks.model_dims import ModelDims

    row["params"] = ModelDims(vocab=vocab, hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv,
                              tied=False).params()
    return row


def part_plan_zero3(dry: bool) -> dict:
    return _plan(3, dry)


def part_plan_zero2(dry: bool) -> dict:
    return _plan(2, dry)


def _memory() -> dict:
    """The device's memory now (bytes): the caching allocator's tensors and reserve, and the driver's free."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "free": free,
            "total": total}


def _timed(fn) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _hand_over(eng) -> dict:
    """One train step, then the hand-over timed, with the device's memory around each call."""
    import math

    import torch

    from rlrecipe.algo.columns import TokenColumns
    from rlrecipe.train.base import TrainSample

    def sample():
        return TrainSample(list(range(5, 69)), 8, TokenColumns(scale=torch.full((56,), 1.0 / 56)))

    def nll(lp, f):
        return -(lp * f.scale).sum(), {}

    step = _timed(lambda: eng.train_step([sample()], nll))
    mem = {"trained": _memory()}
    seconds = {"first_step": step}
    seconds["offload_optimizer"] = _timed(lambda: eng.offload_states("optimizer"))
    mem["optimizer_offloaded"] = _memory()
    seconds["offload_weights"] = _timed(lambda: eng.offload_states("weights"))
    mem["weights_offloaded"] = _memory()
    seconds["reload"] = _timed(eng.reload_states)
    mem["reloaded"] = _memory()
    loss = {}
    seconds["step_after"] = _timed(lambda: loss.setdefault("v", eng.train_step([sample()], nll).loss))
    out = {"seconds": seconds, "memory": mem, "loss_after": float(loss["v"]), "loss_finite": math.isfinite(loss["v"])}
    if mem["trained"]:
        a = {k: v["allocated"] for k, v in mem.items()}
        f = {k: v["free"] for k, v in mem.items()}
        left = a["trained"] - a["weights_offloaded"]
        back = a["reloaded"] - a["weights_offloaded"]
        out |= {"optimizer_bytes_left": a["trained"] - a["optimizer_offloaded"],
                "weights_bytes_left": a["optimizer_offloaded"] - a["weights_offloaded"],
                "bytes_left": left, "bytes_returned": back, "returned_minus_left": back - left,
                "free_gained_bytes": f["weights_offloaded"] - f["trained"],
                "free_after_reload_minus_before": f["reloaded"] - f["trained"],
                "offload_bytes_s": left / (seconds["offload_optimizer"] + seconds["offload_weights"]),
                "reload_bytes_s": back / seconds["reload"]}
    return out


def _handover_model(dry: bool, where: Path) -> Path:
    from rlrecipe.modeling import create_tiny
    from rlrecipe.recipe.training import TinyModel

    return create_tiny(TinyModel(**(HANDOVER_DRY if dry else HANDOVER_GPU)), where / "model", seed=3)


def part_colocated_torch(dry: bool) -> dict:
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.torch_engine import TorchTrainEngine

    with tempfile.TemporaryDirectory() as tmp:
        eng = TorchTrainEngine(_handover_model(dry, Path(tmp)), TrainerSection(lr=1e-3), total_steps=4)
        params = sum(p.numel() for p in eng.model.parameters())
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        out = _hand_over(eng)
    return {"engine": "torch", "dtype": "float32", "params": params, "weights_bytes": weights,
            "expected_bytes_left": 3 * weights, **out}


def part_colocated_deepspeed(dry: bool) -> dict:
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine

    with tempfile.TemporaryDirectory() as tmp:
        model = _handover_model(dry, Path(tmp))
        t = time.perf_counter()
        eng = DeepSpeedTrainEngine(model, TrainerSection(engine="deepspeed", zero_stage=3, lr=1e-3), 4, colocated=True,
                                   ds_config_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
        built = time.perf_counter() - t
        out = _hand_over(eng)
        fused = type(eng.engine.optimizer.optimizer).__name__
    out["seconds"]["engine_built"] = built  # FusedAdam's JIT build on a fresh machine included
    return {"engine": "deepspeed", "zero_stage": 3, "dtype": "float32", "optimizer": fused, **out}


def part_ipc_push(dry: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ipc.json"
        cmd = [sys.executable, str(REPO / "bench" / "gpu" / "ipc_push.py"), *(IPC_DRY if dry else IPC_GPU),
               "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ipc_push.py exited {proc.returncode}: {proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def part_handover_test(dry: bool) -> dict:
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
               "tests/train/test_gpu_colocated_smoke.py", "-k", "torch_engine", f"--junitxml={junit}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if not junit.exists():
            raise RuntimeError(f"pytest exited {proc.returncode} without a report: {proc.stdout[-3000:]}")
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    outcome = "failed" if counts["failures"] or counts["errors"] else "passed" if passed else "skipped"
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "outcome": outcome, "passed": passed,
            **counts, "output_tail": proc.stdout[-2500:]}


def _decode_point(eng, trajs, batch: int, params, rates, spec: dict, cuda: bool) -> dict:
    """One batch of `batch` rows decoded: its wall time and median decoding step, against the rates."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = trajs(batch)
    eng.events = []  # each decoding step: its sampling (which waits for the step before) and forward
    t = time.perf_counter()
    eng.generate(rows, params)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    steps = [e for e in eng.events if e[0] == "decode"][1:] or [e for e in eng.events if e[0] == "decode"]
    eng.events = None
    step_s = statistics.median(e[1] for e in steps)  # the first waited for the prefill: left out
    cells = statistics.median(e[2]["decode_cells"] for e in steps)
    predicted = rates.step_s + rates.row_s * batch + rates.ctx_s * cells
    generated = sum(len(r.response_ids) for r in rows)
    return {"batch": batch, "kv_cache_dtype": eng.kv_cache_dtype, "prompt_tokens": spec["prompt"],
            "new_tokens": spec["new_tokens"], "generated_tokens": generated, "wall_s": wall,
            "tokens_s": generated / wall, "decode_steps": len(steps) + 1, "step_s": step_s,
            "decode_tokens_s": batch / step_s, "us_per_token": step_s / batch * 1e6,
            "cells_per_step": cells, "predicted_step_s_h100_rates": predicted,
            "measured_over_predicted": step_s / predicted,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _decode(kv_cache_dtype: str, dry: bool) -> dict:
    import torch

    from bench.plan_vs_measured import _model_dir
    from rlrecipe.checks.model_dims import ModelDims
    from rlrecipe.checks.step_time import Rates
    from rlrecipe.rollout.inprocess import InProcessEngine
    from rlrecipe.trajectory.record import SamplingParams, Trajectory

    spec = DECODE_DRY if dry else DECODE_GPU
    cuda = torch.cuda.is_available() and not dry
    h, inter, layers, heads, kv, vocab, *_ = spec["cfg"]
    if cuda:  # the engine makes its tensors without a device: the default device puts them on the GPU
        torch.set_default_device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(spec["cfg"], Path(tmp) / "model", dtype=spec["dtype"])
        t = time.perf_counter()
        # eos -1: no row ends early, every row decodes new_tokens; greedy: no sampling generator (the CPU's)
        eng = InProcessEngine(model_dir, eos_token_id=-1, pad_token_id=0, dtype=spec["dtype"],
                              max_batch=max(spec["batches"]), kv_cache_dtype=kv_cache_dtype)
        eng.model.to(torch.get_default_device())
        loaded = time.perf_counter() - t
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_new_tokens=spec["new_tokens"], greedy=True)

        def trajs(n: int) -> list[Trajectory]:
            return [Trajectory(uid=str(i), prompt_ids=torch.randint(1, vocab, (spec["prompt"],), generator=g,
                                                                        device="cpu").tolist())
                    for i in range(n)]

        eng.generate(trajs(min(spec["batches"])), SamplingParams(max_new_tokens=4, greedy=True))  # warm-up
        dims = ModelDims(vocab=vocab, hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, tied=False)
        rates = Rates.of(dims, "bfloat16", False, train_seq_len=spec["prompt"],  # decoding rates alone are read
                         kv_bytes=1 if kv_cache_dtype.startswith("fp8") else None)
        points = [_decode_point(eng, trajs, batch, params, rates, spec, cuda) for batch in spec["batches"]]
    return {"model": {"hidden": h, "intermediate": inter, "layers": layers, "heads": heads, "kv_heads": kv,
                      "vocab": vocab, "params": dims.params(), "dtype": spec["dtype"]},
            "device": "cuda" if cuda else "cpu", "load_s": loaded, "kv_cache_dtype": kv_cache_dtype,
            "rates_h100": {"step_s": rates.step_s, "row_s": rates.row_s, "ctx_s": rates.ctx_s}, "points": points}


def part_decode_bf16(dry: bool) -> dict:
    return _decode("auto", dry)


def part_decode_fp8_e4m3(dry: bool) -> dict:
    return _decode("fp8_e4m3", dry)
