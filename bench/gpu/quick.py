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
it did; each part's log is in quick_logs/ beside it. The parts themselves, and the sizes they run at,
are bench/gpu/quick_parts.py's; this module is the runner around them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.gpu import quick_parts

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

# each part's function, by its name in PARTS (the parts are their own module: quick_parts.py)
FUNCTIONS = {name: getattr(quick_parts, f"part_{name}") for name, *_ in PARTS}


# -- a child process: one part, its result or its error -----------------------------------------
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
