"""The C3PO++ pool's checkpoint at the 7B recipe's size: JSON of Python objects vs arrays.

  python -m bench.pool_checkpoint [--trajectories 128]

Synthetic in-flight rollouts with R1-distilled response lengths (2k-27.6k tokens, uniform) and
1,024-token prompts; 128 trajectories are 1/64 of the 7B recipe's 8,192 a step. Both forms are
written, read back and timed side by side; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from rlrecipe.trajectory.record import Status, Trajectory
from rlrecipe.trajectory.store import load_trajectories, save_trajectories


def synthetic(n: int, seed: int = 0, prompt_tokens: int = 1024) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(2048, 27648)
        out.append(Trajectory(uid=f"p{i}", prompt_ids=[rng.randrange(152064) for _ in range(prompt_tokens)],
                              group_id=f"g{i // 16}",
                              answers=["42"], response_ids=[rng.randrange(152064) for _ in range(length)],
                              logp_infer=[-rng.random() * 3 for _ in range(length)], versions=[7] * length,
                              status=Status.RUNNING, age=1))
    return out


def compare(n: int) -> dict:
    trajs = synthetic(n)
    tokens = sum(t.num_tokens for t in trajs)
    with tempfile.TemporaryDirectory() as d:
        js, arr = Path(d) / "pool.json", Path(d) / "pool.safetensors"
        t0 = time.perf_counter()
        js.write_text(json.dumps({"in_flight": [t.to_dict() for t in trajs]}))
        t1 = time.perf_counter()
        [Trajectory.from_dict(x) for x in json.loads(js.read_text())["in_flight"]]
        t2 = time.perf_counter()
        save_trajectories(arr, trajs)
        t3 = time.perf_counter()
        load_trajectories(arr)
        t4 = time.perf_counter()
        res = {"trajectories": n, "tokens": tokens, "json_save_s": t1 - t0, "json_load_s": t2 - t1,
               "json_mib": js.stat().st_size / 2**20, "arrays_save_s": t3 - t2, "arrays_load_s": t4 - t3,
               "arrays_mib": arr.stat().st_size / 2**20}
    res["save_speedup"] = res["json_save_s"] / res["arrays_save_s"]
    res["size_ratio"] = res["json_mib"] / res["arrays_mib"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=128)
    r = compare(ap.parse_args().trajectories)
    for k, v in r.items():
        print(f"{k:16s} {v:.3f}" if isinstance(v, float) else f"{k:16s} {v}")


if __name__ == "__main__":
    main()
