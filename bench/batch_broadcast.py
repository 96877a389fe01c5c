"""Handing one RL step's graded batch to the trainer ranks: pickled Trajectory lists vs arrays.

  python -m bench.batch_broadcast [--trajectories 128] [--gloo]

Synthetic graded trajectories with R1-distilled response lengths (2,048-27,648 tokens, uniform)
and 200-token prompts; 128 trajectories are 1/64 of the 7B recipe's 8,192 a step, and the last
column scales the measured figures linearly to 8,192. Side by side:

- bytes sent: the pickle `broadcast_object_list` sends of the list (what `run_rl` did), against the
  arrays' bytes plus the pickle of their names, shapes, uids and group ids (what it does now);
- rank 0's seconds to pickle vs to pack, another rank's seconds to unpickle vs to wrap the arrays;
- what another rank holds afterwards: the unpickled lists as tracemalloc counts them (every
  Python object allocated and still alive), against the arrays' own nbytes (torch allocates them
  outside tracemalloc's view) plus the tracemalloc count of the unpickled uids and group ids.

--gloo also times the real thing: 2 processes on this machine, gloo, each way once. Nothing here
is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import tempfile
import time
import tracemalloc

from bench.pool_checkpoint import synthetic
from rlrecipe.trajectory.arrays import TrajectoryBatch
from rlrecipe.trajectory.record import Status, Trajectory

RECIPE_TRAJECTORIES = 8192  # the 7B recipe's batch a step


def graded(n: int) -> list[Trajectory]:
    trajs = synthetic(n, prompt_tokens=200)
    for i, t in enumerate(trajs):  # as `grade` leaves them
        t.status = Status.TRUNCATED if i % 5 == 0 else Status.FINISHED
        t.correct = i % 3 == 0
        t.reward = 5.0 if t.correct else -5.0
    return trajs


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _traced_bytes(fn) -> tuple[object, int]:
    """fn's result and the bytes of Python allocations it made that are still alive."""
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, current


def compare(n: int) -> dict:
    trajs = graded(n)
    tokens = sum(t.num_tokens for t in trajs)
    # before: the list itself through broadcast_object_list's pickle
    blob, pickle_s = _timed(lambda: pickle.dumps(trajs))
    _, unpickle_s = _timed(lambda: pickle.loads(blob))
    lists, lists_bytes = _traced_bytes(lambda: pickle.loads(blob))
    del lists
    # after: arrays by tensor broadcast, the small metadata pickled
    batch, pack_s = _timed(lambda: TrajectoryBatch.from_trajectories(trajs))
    arrays_bytes = sum(t.numel() * t.element_size() for t in batch.arrays.values())
    layout = {name: (tuple(t.shape), t.dtype) for name, t in batch.arrays.items()}
    meta = pickle.dumps((layout, (batch.uids, batch.group_ids)))

    def receive():
        _layout, (uids, group_ids) = pickle.loads(meta)
        return TrajectoryBatch(batch.arrays, uids, group_ids)  # the broadcast fills arrays shaped by _layout

    _, wrap_s = _timed(receive)
    _, meta_resident = _traced_bytes(receive)
    return {"trajectories": n, "tokens": tokens,
            "sent_bytes": (len(blob), arrays_bytes + len(meta)),
            "lead_s": (pickle_s, pack_s),
            "receive_s": (unpickle_s, wrap_s),
            "resident_bytes": (lists_bytes, arrays_bytes + meta_resident)}


# -- the real broadcast, 2 gloo processes --------------------------------------------------------
def _gloo_rank(rank: int, n: int, store: str, results) -> None:
    import torch.distributed as dist

    from rlrecipe.trajectory.arrays import broadcast_batch_from_rank_zero

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    trajs = graded(n) if rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    box = [trajs]
    dist.broadcast_object_list(box, src=0)
    lists_s = time.perf_counter() - t0
    del box
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    broadcast_batch_from_rank_zero(lambda: (TrajectoryBatch.from_trajectories(trajs), None))
    arrays_s = time.perf_counter() - t0
    results.put((rank, lists_s, arrays_s))
    dist.destroy_process_group()


def gloo_seconds(n: int) -> dict[int, tuple[float, float]]:
    """Per rank: seconds of the list broadcast, then of the array broadcast (rank 0's include pickling / packing)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_gloo_rank, args=(r, n, os.path.join(d, "store"), results)) for r in (0, 1)]
        for p in procs:
            p.start()
        out = {}
        for _ in procs:
            rank, lists_s, arrays_s = results.get(timeout=1800)
            out[rank] = (lists_s, arrays_s)
        for p in procs:
            p.join()
    return out


def _fmt(kind: str, v: float) -> str:
    return f"{v / 2**20:,.1f} MiB" if kind == "bytes" else f"{v:.3f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=128)
    ap.add_argument("--gloo", action="store_true", help="also time a real 2-process gloo broadcast")
    args = ap.parse_args()
    r = compare(args.trajectories)
    n, tokens = r["trajectories"], r["tokens"]
    scale = RECIPE_TRAJECTORIES / n
    print(f"{n} trajectories, {tokens:,} tokens (200-token prompts, responses 2,048-27,648 uniform)")
    print(f"{'':34s} {'lists (pickle)':>16s} {'arrays':>16s} {'ratio':>7s}   at {RECIPE_TRAJECTORIES:,} trajectories"
          " (linear): lists / arrays")
    rows = [("sent to every rank", "sent_bytes", "bytes"), ("rank 0: pickle | pack", "lead_s", "s"),
            ("other ranks: unpickle | wrap", "receive_s", "s"),
            ("other ranks: resident after", "resident_bytes", "bytes")]
    for label, key, kind in rows:
        old, new = r[key]
        print(f"{label:34s} {_fmt(kind, old):>16s} {_fmt(kind, new):>16s} {old / max(new, 1e-12):6.1f}x   "
              f"{_fmt(kind, old * scale)} / {_fmt(kind, new * scale)}")
    old, new = r["resident_bytes"]
    print(f"{'resident bytes per token':34s} {old / tokens:16.1f} {new / tokens:16.1f}")
    print("resident: lists by tracemalloc (live Python allocations after unpickling); arrays by tensor nbytes "
          "+ tracemalloc of the unpickled metadata")
    if args.gloo:
        secs = gloo_seconds(n)
        for rank, (lists_s, arrays_s) in sorted(secs.items()):
            print(f"{f'gloo 2 ranks, rank {rank} wall':34s} {_fmt('s', lists_s):>16s} {_fmt('s', arrays_s):>16s} "
                  f"{lists_s / max(arrays_s, 1e-12):6.1f}x")


if __name__ == "__main__":
    main()
