"""What only a GPU can tell, in one call that fits a short loan (`make gpu-quick`): 8 minutes by default
from a cold start, the most valuable part first, one JSON written after every part.

    python3 -m bench.gpu.quick                       # on the GPU machine; JSON in $OUT (or runs/gpu-quick)
    python3 -m bench.gpu.quick --cpu-dry-run         # every part at toy sizes on this CPU (the logic only)
    python3 -m bench.gpu.quick --parts plan_zero3,decode_bf16 --deadline-s 300 --budget decode_bf16=60

First the dependencies the image lacks: where pydantic, math-verify, datasets or DeepSpeed cannot be
imported and .gpu-carry/install.sh (`make gpu-carry`) is there, it is run (pip from the carried wheels,
no index) and its PYTHONPATH and DS_ACCELERATOR passed to every part. Then the parts, in this order:

  env                  the GPU, torch, CUDA and the libraries' versions
  plan_zero3/zero2     `rlrecipe plan`'s per-rank training peak against torch.cuda.max_memory_allocated
                       over a DeepSpeed step on one GPU (bench/plan_vs_measured_ds.py's measurement, for
                       one mid-size synthetic model: 1024 hidden, 8 layers, the 152,064 vocabulary, 400M
                       parameters, bf16, 8,192 tokens a micro-batch, gradient checkpointing)
  colocated_torch      the hand-over: offload_states("optimizer"), ("weights"), reload_states() of the
  colocated_deepspeed  torch engine and of DeepSpeed ZeRO-3 with FusedAdam (its build included), each
                       timed, with memory_allocated and mem_get_info around each (bytes that left the
                       device and came back), then a step to show training goes on
  ipc_push             the push by handle (bench/gpu/ipc_push.py with 7B's shapes at 4 layers)
  handover_test        tests/train/test_gpu_colocated_smoke.py's torch-engine test (amended since the
                       H100: exact engine bytes, the allocator's 1 MiB slack), by pytest with a limit
  decode_bf16/fp8_e4m3 the in-process engine's decode tokens/s at batches 8, 32, 128 with the KV cache
                       in bf16 and in FP8 (R1-Distill-Qwen-1.5B's shapes, random bf16 weights), beside the
                       seconds a decoding step takes in rlrecipe/checks/step_time.py's Rates

Each part runs in a process of its own (a process group, killed at its limit) with a limit of its own
(`budget_s`); a part starts only if its whole budget fits before the deadline, else it is recorded as
skipped. A part's error is recorded and the next part runs. The JSON (docs/gpu.md, "Running the GPU
checks", says what each field means) is rewritten after every part, so a run cut short keeps what
it did; each part's log is in quick_logs/ beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "rlrecipe-gpu-quick/1"
DEADLINE_S = 480.0
DRY_DEADLINE_S = 1200.0
CARRIED = ("pydantic", "math_verify", "datasets", "deepspeed")  # what the GPU image lacks (make gpu-carry)
INSTALL_BUDGET_S = 120.0
# (name, budget on a GPU, budget in the CPU dry run), in order of value: each is the part's limit
PARTS = [
    ("env", 45, 60),
    ("plan_zero3", 150, 400),
    ("plan_zero2", 120, 400),
    ("colocated_torch", 60, 120),
    ("colocated_deepspeed", 180, 240),
    ("ipc_push", 60, 120),
    ("handover_test", 120, 180),
    ("decode_bf16", 90, 120),
    ("decode_fp8_e4m3", 90, 120),
]
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


# -- the parts (each runs in a child process) ------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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
        rates = Rates.of(dims, "bfloat16", False, kv_bytes=1 if kv_cache_dtype.startswith("fp8") else None)
        points = [_decode_point(eng, trajs, batch, params, rates, spec, cuda) for batch in spec["batches"]]
    return {"model": {"hidden": h, "intermediate": inter, "layers": layers, "heads": heads, "kv_heads": kv,
                      "vocab": vocab, "params": dims.params(), "dtype": spec["dtype"]},
            "device": "cuda" if cuda else "cpu", "load_s": loaded, "kv_cache_dtype": kv_cache_dtype,
            "rates_h100": {"step_s": rates.step_s, "row_s": rates.row_s, "ctx_s": rates.ctx_s}, "points": points}


def part_decode_bf16(dry: bool) -> dict:
    return _decode("auto", dry)


def part_decode_fp8_e4m3(dry: bool) -> dict:
    return _decode("fp8_e4m3", dry)


FUNCTIONS = {name: globals()[f"part_{name}"] for name, *_ in PARTS}


def child(name: str, result: Path, dry: bool, fail: set[str]) -> int:
    try:
        if name in fail:
            raise RuntimeError(f"--fail {name}: this part fails on purpose")
        out = {"result": FUNCTIONS[name](dry)}
        code = 0
    except BaseException as e:  # noqa: BLE001 - every error is the part's result
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        code = 1
    result.write_text(json.dumps(out, default=str))
    return code


# -- the parent: install, then each part in order against the deadline ----------------------------
class Run:
    def __init__(self, out: Path, deadline_s: float, dry: bool, budgets: dict[str, float], argv: list[str]):
        self.out, self.deadline_s, self.dry = out, deadline_s, dry
        self.logs = out.parent / "quick_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.proc: subprocess.Popen | None = None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        self.doc = {"schema": SCHEMA, "command": " ".join(["python3 -m bench.gpu.quick", *argv]),
                    "cpu_dry_run": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "finished": None,
                    "deadline_s": deadline_s, "elapsed_s": 0.0, "setup": None, "order": [],
                    "parts": {}, "decode_points": []}
        self.budgets = budgets

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
        self.doc["decode_points"] = [p for part in self.doc["parts"].values()
                                     for p in (part.get("result") or {}).get("points", [])]
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)

    def setup(self, install: bool) -> None:
        """The carried wheels installed where the image lacks what they hold."""
        missing = [m for m in CARRIED if importlib.util.find_spec(m) is None]
        script = REPO / ".gpu-carry" / "install.sh"
        rec = {"missing": missing, "carry_present": script.exists(), "installed": False, "seconds": 0.0}
        if missing and install and script.exists():
            t = time.monotonic()
            try:
                proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=REPO,
                                      timeout=INSTALL_BUDGET_S)
                rec["returncode"] = proc.returncode
                rec["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
                for line in proc.stdout.splitlines():  # "export PYTHONPATH=... DS_ACCELERATOR=cuda"
                    if line.startswith("export "):
                        for kv in line[len("export "):].split():
                            k, _, v = kv.partition("=")
                            rec.setdefault("env", {})[k] = v
                if proc.returncode == 0 and "env" in rec:
                    env = rec["env"]
                    if "PYTHONPATH" in env:
                        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
                    self.env.update(env)
                    rec["installed"] = True
            except subprocess.TimeoutExpired:
                rec["error"] = f"install.sh ran past {INSTALL_BUDGET_S:.0f}s"
            rec["seconds"] = round(time.monotonic() - t, 2)
        self.doc["setup"] = rec
        self.save()

    def run_part(self, name: str, budget: float, fail: set[str]) -> None:
        rec = {"status": "pending", "budget_s": budget}
        self.doc["parts"][name] = rec
        self.doc["order"].append(name)
        left = self.deadline_s - self.elapsed()
        if budget > left:
            rec |= {"status": "skipped", "reason": f"its budget {budget:.0f}s exceeds the {max(0.0, left):.0f}s left "
                                                   f"before the {self.deadline_s:.0f}s deadline"}
            self.save()
            return
        rec |= {"status": "running", "started_at_s": round(self.elapsed(), 2)}
        self.save()
        result = self.logs / f"{name}.result.json"
        result.unlink(missing_ok=True)
        log = self.logs / f"{name}.log"
        cmd = [sys.executable, "-m", "bench.gpu.quick", "--child", name, "--result", str(result)]
        cmd += ["--cpu-dry-run"] if self.dry else []
        cmd += ["--fail", ",".join(sorted(fail))] if fail else []
        t = time.monotonic()
        with log.open("w") as fh:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            try:
                code = self.proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                self._kill()
                code = None
            self.proc = None
        rec["seconds"] = round(time.monotonic() - t, 2)
        tail = log.read_text(errors="replace")[-3000:]
        got = json.loads(result.read_text()) if result.exists() else {}
        if code is None:
            rec |= {"status": "timeout", "error": f"killed at its {budget:.0f}s budget", "log_tail": tail}
        elif "result" in got and code == 0:
            rec |= {"status": "ok", "result": got["result"]}
        else:
            rec |= {"status": "error", "error": got.get("error", f"exited {code} without a result"),
                    "traceback": got.get("traceback"), "log_tail": tail}
        self.save()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def interrupted(self, signum, _frame) -> None:
        self._kill()
        for rec in self.doc["parts"].values():
            if rec["status"] == "running":
                rec |= {"status": "interrupted", "error": f"signal {signum} during the part"}
        self.doc["interrupted"] = f"signal {signum} at {self.elapsed():.0f}s"
        self.save()
        sys.exit(128 + signum)


def default_out() -> Path:
    return Path(os.environ["OUT"] if os.environ.get("OUT") else REPO / "runs" / "gpu-quick") / "gpu_quick.json"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="the JSON (default $OUT/gpu_quick.json, else runs/gpu-quick/)")
    ap.add_argument("--deadline-s", type=float, help=f"the whole run's limit (default {DEADLINE_S:.0f}; "
                                                     f"{DRY_DEADLINE_S:.0f} in the dry run)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="every part at toy sizes on the CPU")
    ap.add_argument("--parts", help="comma-separated, in this script's order (default: all)")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="a part's limit")
    ap.add_argument("--fail", default="", help="comma-separated parts that raise at once (tests the recording)")
    ap.add_argument("--no-install", action="store_true", help="do not run .gpu-carry/install.sh")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    fail = {p for p in args.fail.split(",") if p}
    if args.child:
        return child(args.child, args.result, args.cpu_dry_run, fail)
    known = [name for name, *_ in PARTS]
    chosen = args.parts.split(",") if args.parts else known
    unknown = [p for p in chosen + list(fail) + [b.split("=")[0] for b in args.budget] if p not in known]
    if unknown:
        ap.error(f"unknown parts {unknown}: expected some of {', '.join(known)}")
    budgets = {name: float(dry if args.cpu_dry_run else gpu) for name, gpu, dry in PARTS}
    budgets |= {k: float(v) for k, v in (b.split("=", 1) for b in args.budget)}
    deadline = args.deadline_s or (DRY_DEADLINE_S if args.cpu_dry_run else DEADLINE_S)
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(out, deadline, args.cpu_dry_run, budgets, argv)
    signal.signal(signal.SIGTERM, run.interrupted)
    signal.signal(signal.SIGINT, run.interrupted)
    run.setup(install=not args.no_install and not args.cpu_dry_run)
    for name in (n for n in known if n in chosen):
        run.run_part(name, budgets[name], fail)
        rec = run.doc["parts"][name]
        print(f"[{run.elapsed():6.1f}s] {name}: {rec['status']}"
              + (f" ({rec['seconds']}s)" if "seconds" in rec else "")
              + (f" - {rec.get('error') or rec.get('reason')}" if rec["status"] != "ok" else ""), flush=True)
    run.doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run.save()
    print(f"wrote {out}")
    return 0


def decode_points(path: str | Path) -> list[dict]:
    """The measured decoding points of a gpu_quick.json (what a projection reads): one dict a batch size
    and KV cache dtype, with decode_tokens_s, step_s, us_per_token and the step_time Rates' prediction."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} file")
    return doc["decode_points"]


if __name__ == "__main__":
    sys.exit(main())
