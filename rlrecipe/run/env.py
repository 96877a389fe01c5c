"""What a run records of its machine in env.json: commit, versions, CPU, threads, devices.

Two machines that differ here can give different numbers from the same recipe and seed; a resume
compares the threads (runs.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.threads import thread_record

KEY_PACKAGES = ["torch", "transformers", "tokenizers", "datasets", "math-verify", "deepspeed", "pydantic", "sglang"]


def git_state(cwd: str | Path | None = None) -> dict[str, Any]:
    cwd = str(cwd or Path(__file__).resolve().parents[2])
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd, capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": dirty}


def environment() -> dict[str, Any]:
    versions = {}
    for name in KEY_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - environment capture must never fail a run
        pass
    return {
        **git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_record(),
        "gpus": gpus,
        "packages": versions,
    }


# Settings that change which CPU kernels run, hence the low bits of every float: recorded as set.
CPU_KERNEL_ENVS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_record() -> dict[str, Any]:
    """The CPU and the kernels torch picks on it. Two CPUs that differ here can give different
    numbers from the same recipe and seed (vector width and BLAS code paths change rounding)."""
    out: dict[str, Any] = {"model": None, "flags": [], "aten_capability": None, "torch_threads": None,
                           "env": {k: os.environ[k] for k in CPU_KERNEL_ENVS if k in os.environ}}
    try:
        info = Path("/proc/cpuinfo").read_text()
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and out["model"] is None:
                out["model"] = value.strip()
            elif key.strip() == "flags":
                have = set(value.split())
                out["flags"] = [f for f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
                break
    except OSError:
        out["model"] = platform.processor() or None
    try:
        import torch

        out["aten_capability"] = torch.backends.cpu.get_cpu_capability()
        out.update(thread_record())
    except Exception:  # noqa: BLE001 - environment capture must never fail a run
        pass
    return out


def record_model(run_dir: Path, record: dict[str, Any]) -> None:
    """Add the resolved starting model (snapshot commit, chat template sha256) to env.json."""
    path = Path(run_dir) / "env.json"
    if not path.exists():
        return
    env = json.loads(path.read_text())
    env["model"] = record
    atomic_write_text(path, json.dumps(env, indent=2))
