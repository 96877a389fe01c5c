"""Recipes for cluster jobs on this machine (CPU, gloo, DeepSpeed ZeRO-2, `rlrecipe serve` servers),
and what their runs leave behind."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import rl_recipe, write_recipe

STANDIN = ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}"]
TIMING = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "step_wall_s"}


def job_recipe(root: Path, data: Path, model: Path, *, trainer: dict, rollout: dict, steps: int = 2) -> Path:
    spec = rl_recipe(root, data, str(model), steps=steps, c3po={"enabled": False})
    spec["eval"]["benchmarks"] = []
    spec["trainer"] = {**spec["trainer"], "engine": "deepspeed", "zero_stage": 2, **trainer}
    spec["rollout"] = {**spec["rollout"], **rollout}
    root.mkdir(parents=True, exist_ok=True)
    return write_recipe(root / "rl.yaml", spec)


def sglang_servers(port: int, nodes: int, servers: int, **extra) -> dict:
    return {"engine": "sglang", "dtype": "float32", "sglang": {
        "base_port": port, "num_servers": servers, "nodes": nodes, "weight_sync": "disk", "startup_timeout_s": 120,
        "launch_cmd": STANDIN + extra.pop("flags", []), **extra}}


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def untimed_rows(run: Path) -> list[dict]:
    """The metrics without wall-clock figures: what two runs of the same recipe must repeat exactly."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in metrics(run)]
