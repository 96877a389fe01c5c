"""Peak memory of one training micro-batch at the real vocabulary: full logits vs chunked.

  python -m bench.logprob_memory                      # CPU: tiny width, V = 152,064 (RSS, one process per point)
  python -m bench.logprob_memory --model 7b --tokens 4096,16384,30720   # GPU: R1-Distill-Qwen-7B's dimensions

"full" is the path the trainer used before chunking (the whole micro-batch's logits, `.float()`,
`log_softmax`, gather), kept here only as the baseline; "chunked" is the trainer's path
(`rlrecipe.train.logprobs`). Each point runs forward and backward of the log-probs of every
response token (90% of each packed sequence) and reports the peak above the weights. The
slope between two token counts is the memory per token; the figures print side by side.
Random weights: memory does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlrecipe.algo.packing import pack
from rlrecipe.modeling import enable_checkpointing
from rlrecipe.train.logprobs import response_logprobs
from rlrecipe.train.varlen_attention import NAME as VARLEN
from rlrecipe.train.varlen_attention import register, training_attention

VOCAB = 152_064
SHAPES = {
    # hidden, intermediate, layers, heads, kv heads (DeepSeek-R1-Distill-Qwen-7B's config.json)
    "7b": (3584, 18944, 28, 28, 4),
    "tiny": (64, 128, 2, 4, 4),
}


def build(shape: str, device: str, dtype: torch.dtype, attn: str):
    h, inter, layers, heads, kv = SHAPES[shape]
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                      tie_word_embeddings=False, use_sliding_window=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    enable_checkpointing(model)
    model.train()
    return model


def full_logits(model, ids, pos, rows, targets):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
    return torch.log_softmax(logits[rows], dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def batch(tokens: int, docs: int, device: str):
    g = torch.Generator().manual_seed(0)
    n = tokens // docs
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for _ in range(docs)]
    ids, pos = pack(seqs)
    rows = torch.cat([torch.arange(i * n + n // 10 - 1, (i + 1) * n - 1) for i in range(docs)])
    targets = ids[0, rows + 1]
    return ids.to(device), pos.to(device), rows.to(device), targets.to(device)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(shape: str, path: str, tokens: int, device: str, chunk: int, attn: str | None = None) -> dict:
    """One point: peak memory (MiB) above the model's own, for forward + backward; on CUDA also the
    seconds of a second forward + backward (the first pays for kernel selection)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attn = attn or training_attention("sdpa")  # what the trainer loads there
    if attn == VARLEN:
        register()
    model = build(shape, device, dtype, attn)
    ids, pos, rows, targets = batch(tokens, 4, device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        warm = batch(64, 1, device)  # touch every code path once so its buffers count in the base
        response_logprobs(model, *warm, chunk_tokens=chunk)[0].sum().backward()
        full_logits(model, *warm).sum().backward()
        model.zero_grad(set_to_none=False)
        base = rss_mib()
    def forward_backward():
        if path == "full":
            logp = full_logits(model, ids, pos, rows, targets)
        else:
            logp, _ = response_logprobs(model, ids, pos, rows, targets, chunk_tokens=chunk)
        logp.sum().backward()

    point = {"shape": shape, "path": path, "attn": attn, "tokens": tokens}
    try:
        forward_backward()
        seconds = None
        if device == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward_backward()
            torch.cuda.synchronize()
            seconds = round(time.perf_counter() - t0, 3)
    except torch.OutOfMemoryError:
        return {**point, "peak_mib": None, "oom": True}
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = rss_mib() - base
    return {**point, "peak_mib": round(peak, 1), "oom": False, "seconds": seconds,
            "weights_mib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1)}


def one_process(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.logprob_memory", "--point", *args],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_token(points: list[dict]) -> float | None:
    ok = [p for p in points if not p["oom"]]
    if len(ok) < 2:
        return None
    a, b = ok[0], ok[-1]
    return (b["peak_mib"] - a["peak_mib"]) / (b["tokens"] - a["tokens"])


def run(shape: str, tokens: list[int], device: str, chunk: int, paths=("full", "chunked"),
        attn: str | None = None) -> dict:
    results: dict = {"shape": shape, "device": device, "vocab": VOCAB, "chunk_tokens": chunk, "points": []}
    for path in paths:
        pts = []
        for t in tokens:
            if device == "cuda":
                p = measure(shape, path, t, device, chunk, attn)
                torch.cuda.empty_cache()
            else:  # RSS is a high-water mark: one fresh process per point
                p = one_process(["--model", shape, "--path", path, "--tokens", str(t), "--chunk", str(chunk),
                                 *(["--attn", attn] if attn else [])])
            print(json.dumps(p), flush=True)
            pts.append(p)
        results["points"] += pts
        results[f"{path}_mib_per_token"] = per_token(pts)
    full, chunked = results.get("full_mib_per_token"), results.get("chunked_mib_per_token")
    print(f"{shape} on {device}, V = {VOCAB}: MiB per token full {full}, chunked {chunked} "
          f"(one fp32 logits row is {VOCAB * 4 / 2**20:.3f} MiB)")
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--path", default="chunked", choices=["full", "chunked"])
    ap.add_argument("--paths", default="full,chunked", help="which paths a sweep measures")
    ap.add_argument("--attn", default=None, choices=["sdpa", VARLEN, "eager"],
                    help="attention to load (default: what the trainer loads on this device)")
    ap.add_argument("--point", action="store_true", help="measure one point in this process (internal)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.point:
        print(json.dumps(measure(a.model, a.path, tokens[0], a.device, a.chunk, a.attn)))
        return
    res = run(a.model, tokens, a.device, a.chunk, a.paths.split(","), a.attn)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
