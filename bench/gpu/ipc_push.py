"""The push by handle (`weight_sync: ipc`) on one GPU, timed and checked bit for bit: a trainer
process shares the 7B model's weights (Qwen2.5-7B's shapes, bf16, random) bucket by bucket through
rlrecipe/rollout/weights/handles.py's SharedBucket, and a second process on the same GPU (the
colocated server's place) maps each bucket's CUDA IPC handles as SGLang does (the device named by
its UUID, mapped back to an index: SGLang's utils/patch_torch.py) and copies them into its own
weights; after each bucket the trainer copies it to host memory, as rank 0 does for the verification
(handle_push.py, handles.HostMirror: pinned buffers kept from push to push; the first push allocates
them). Also timed: a device-to-host copy into fresh pageable memory (what an earlier version did, and
what the disk push's export still does), into pageable memory written before, and into pinned memory.

What it does not cover: ZeRO-3's gather across ranks (one GPU here), SGLang's own request path
(HTTP, its scheduler, load_weights), and the servers one after another. Standalone: needs torch
and a CUDA GPU, not the rest of rlrecipe (the device machine has no pydantic).

    python3 bench/gpu/ipc_push.py --out bench/gpu/ipc_push_h100.json
    python3 bench/gpu/ipc_push.py --layers 4 --reps 3        # smaller, as make gpu-quick runs it
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import pickle
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WEIGHTS = Path(__file__).resolve().parents[2] / "rlrecipe" / "rollout" / "weights"
DEVICE_ARG = 6  # rebuild_cuda_tensor's argument naming the device (handles.DEVICE_ARG)
# Qwen2.5-7B (DeepSeek-R1-Distill-Qwen-7B): hidden, intermediate, layers, kv dim, vocab; untied head
HIDDEN, INTER, LAYERS, KV, VOCAB = 3584, 18944, 28, 512, 152064
# --small: a smoke test of the script itself (on a CPU too): 7B's tensors by name, at a toy width
SMALL = dict(layers=2, vocab=1024, hidden=256, inter=1024, kv=64)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shapes_7b(layers: int = LAYERS, vocab: int = VOCAB, hidden: int = HIDDEN, inter: int = INTER,
              kv: int = KV) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def fingerprint(t: torch.Tensor) -> int:
    return int(t.contiguous().view(torch.int16).to(torch.int64).sum())


def receiver(conn, shapes, device: str) -> None:
    """The server's side: map each bucket's handles (the UUID mapped back), copy, answer the seconds."""
    from torch.multiprocessing import reductions

    rebuild = reductions.rebuild_cuda_tensor
    index = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}

    def rebuild_by_uuid(*args):
        if isinstance(args[DEVICE_ARG], str):
            args = (*args[:DEVICE_ARG], index[args[DEVICE_ARG]], *args[DEVICE_ARG + 1:])
        return rebuild(*args)

    reductions.rebuild_cuda_tensor = rebuild_by_uuid  # what pickle finds by name, as SGLang patches it
    dst = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg == "fingerprints":
            conn.send({name: fingerprint(t) for name, t in dst.items()})
            continue
        t0 = time.perf_counter()
        named = pickle.loads(base64.b64decode(msg))
        t1 = time.perf_counter()
        for name, t in named:
            dst[name].copy_(t)
        sync()
        t2 = time.perf_counter()
        del named
        conn.send((t1 - t0, t2 - t1))


def load(name: str):
    """rlrecipe/rollout/weights/NAME.py alone (torch only), without the package's imports."""
    spec = importlib.util.spec_from_file_location(f"rlrecipe_{name}", WEIGHTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def push(handles, sync_module, src: list, bucket_bytes: int, conn, mirror) -> dict:
    """One push as handle_push.push_by_handles does it on rank 0, the server answering each bucket;
    `mirror` (handles.HostMirror, kept from push to push as rank 0 keeps it) takes the copy for the
    verification, None: no copy."""
    sync()
    parts = dict(share_s=0.0, server_open_s=0.0, server_copy_s=0.0, wait_s=0.0, cpu_copy_s=0.0)
    pushed, n = {}, 0
    start = time.perf_counter()
    for chunk in sync_module.buckets(src, bucket_bytes):
        t0 = time.perf_counter()
        shared = handles.SharedBucket(chunk)
        t1 = time.perf_counter()
        conn.send(shared.payload)
        opened, copied = conn.recv()
        t2 = time.perf_counter()
        if mirror is not None:
            mirror.copy(shared.views)  # asynchronous: its wait is timed at the end
        t3 = time.perf_counter()
        del shared
        n += 1
        parts["share_s"] += t1 - t0
        parts["server_open_s"] += opened
        parts["server_copy_s"] += copied
        parts["wait_s"] += t2 - t1
        parts["cpu_copy_s"] += t3 - t2
    t4 = time.perf_counter()
    if mirror is not None:
        pushed = mirror.finish()
    sync()
    parts["cpu_copy_s"] += time.perf_counter() - t4
    return {"seconds": time.perf_counter() - start, "buckets": n, **parts}, pushed


def copy_rates(nbytes: int, reps: int = 6) -> dict[str, float]:
    """Bytes a second of one device-to-host copy of `nbytes`: into fresh pageable memory (x.to("cpu"),
    as cpu_copy and full_state_dict do), into a pageable buffer written before, into a pinned buffer."""
    if not torch.cuda.is_available():
        return {}
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    reused = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    out = {}
    for name, copy in (("fresh_pageable", lambda: x.to("cpu", copy=True)), ("reused_pageable", lambda: reused.copy_(x)),
                       ("pinned", lambda: pinned.copy_(x))):
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"d2h_{name}_bytes_s"] = nbytes / statistics.median(times[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="2 layers, a 1024-token vocabulary, hidden size 256")
    ap.add_argument("--layers", type=int, help=f"7B's shapes with this many layers (default {LAYERS}; "
                                               "make gpu-quick: 4, 4.0 GB)")
    args = ap.parse_args()
    handles, sync_module = load("handles"), load("sync")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = shapes_7b(**{**SMALL, **({'layers': args.layers} if args.layers else {})}) if args.small else \
        shapes_7b(layers=args.layers or LAYERS)
    torch.manual_seed(0)
    src = [(name, torch.randn(shape, dtype=torch.bfloat16, device=device)) for name, shape in shapes]
    weights = sum(t.numel() * t.element_size() for _, t in src)
    bucket_bytes = args.bucket_mb << 20
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    out = {"device": f"{name}, torch {torch.__version__}",
           "date": time.strftime("%Y-%m-%d"), "command": "python3 bench/gpu/ipc_push.py",
           "params": sum(t.numel() for _, t in src), "weights_bytes": weights, "bucket_mb": args.bucket_mb,
           "d2h_of_a_bucket": copy_rates(bucket_bytes), "d2h_of_4_gib": copy_rates(4 << 30)}

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, shapes, device))
    proc.start()
    try:
        runs = []
        mirror = handles.HostMirror()
        for rep in range(args.reps):
            row, pushed = push(handles, sync_module, src, bucket_bytes, here, mirror)
            runs.append({**row, "cpu_copy": True})
            if rep == 0:
                here.send("fingerprints")
                served = here.recv()
                mine = {name: fingerprint(t) for name, t in src}
                kept = {name: fingerprint(t) for name, t in pushed.items()}
                out["served_bit_for_bit"] = served == mine
                out["cpu_copy_bit_for_bit"] = kept == mine
            del pushed
        for _ in range(max(1, args.reps - 1)):
            row, _ = push(handles, sync_module, src, bucket_bytes, here, None)
            runs.append({**row, "cpu_copy": False})
    finally:
        here.send(None)
        proc.join(60)
    out["runs"] = runs
    warm = [r for r in runs[1:] if r["cpu_copy"]] or [runs[0]]
    bare = [r for r in runs if not r["cpu_copy"]]
    out["push_s_median"] = statistics.median(r["seconds"] for r in warm)
    out["push_without_cpu_copy_s_median"] = statistics.median(r["seconds"] for r in bare)
    out["handles_bytes_s"] = weights / out["push_without_cpu_copy_s_median"]
    out["cpu_copy_bytes_s"] = weights / statistics.median(r["cpu_copy_s"] for r in warm)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
