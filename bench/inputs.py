"""What `make bench` measures on: the demo's tiny-arith data and its SFT model, made when missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rich.console import Console

console = Console()
DATA = Path("data/tiny-arith")
MODEL = Path("runs/tiny-sft/final")


def ensure_inputs() -> None:
    """The benchmarks use the demo's SFT model: its responses have the task's long-tail lengths."""
    if not (DATA / "rl.jsonl").exists():
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "data", "make", "tiny-arith", "--out", str(DATA)],
                       check=True)
    if not (MODEL / "config.json").exists():
        console.print("no runs/tiny-sft/final yet: training it with recipes/tiny_sft.yaml first")
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "sft", "recipes/tiny_sft.yaml",
                        "--set", "eval.benchmarks=[]"], check=True)
