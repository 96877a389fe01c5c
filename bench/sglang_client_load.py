"""The SGLang client under many open requests: threads it holds and wall time, against a stand-in
server (no model) that answers every /generate after 1 s. `python -m bench.sglang_client_load 512`."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.rollout.test_sglang_hang import STAND_IN, free_ports


def main(n: int = 512) -> None:
    cfg = SGLangServer(base_port=free_ports(1), startup_timeout_s=60, max_concurrency=max(n, 1),
                       launch_cmd=[sys.executable, "-c", STAND_IN, "{port}", "1.0"])
    eng = SGLangEngine.launch("stand-in", cfg=cfg, run_dir=Path(tempfile.mkdtemp()), eos_token_id=1)
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.01)

    before = threading.active_count()
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.perf_counter()
    try:
        eng.generate([Trajectory(uid=str(i), group_id=str(i), prompt_ids=[5]) for i in range(n)],
                     SamplingParams(max_new_tokens=1))
    finally:
        done.set()
        watcher.join()
    wall = time.perf_counter() - t0
    with urllib.request.urlopen(eng.urls[0] + "/stats", timeout=10) as r:
        stats = json.loads(r.read())
    eng.close()
    print(f"{n} requests of 1 s each: {wall:.2f} s wall, server saw {stats['peak']} open at once; "
          f"client threads {before} before, peak {peak[0] - 1} during (the watcher not counted)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
