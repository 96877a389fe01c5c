"""Where a training step's memory peaks, phase by phase, on CPU: what the plan's phases are read from.

  python -m bench.step_phases step '[256, 704, 4, 4, 2, 32768, 2048, false]'   # a config as in plan_vs_measured
  python -m bench.step_phases head                                              # the head's backward alone

Run it with the mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=131072`, as plan_vs_measured
does) so that RSS follows the tensors.

`step`: one warmed step of the configuration (bench/plan_vs_measured.py's child), then a second
one with hooks at every module's forward, every weight's gradient and the optimizer's step; at
each hook the kernel's high-water mark is read and reset, so each line is the peak RSS (above the
baseline) between two hooks.

`head`: forward and backward of `train/logprobs.py`'s chunked log-probs at several shapes, the
head's weight gradient already present (a later micro-batch); the peak in [chunk x V] fp32 copies.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.plan_vs_measured import _reset_peak, _status_kib, _step, warmed_baseline

HEAD_SHAPES = [(32768, 256, 1024, 2048), (152064, 512, 1024, 2048), (152064, 768, 1024, 1024),
               (65536, 384, 1024, 4096)]  # vocab, hidden, chunk, rows


def step_phases(cfg, work: Path) -> list[tuple[str, float]]:
    from rlrecipe.stages.sft import sft_step

    model_dir, base = warmed_baseline(cfg, work)
    engine, batch = _step(model_dir, cfg, 2)
    log: list[tuple[str, float]] = []

    def mark(label: str) -> None:
        log.append((label, (_status_kib("VmHWM") - base) / 1024))
        _reset_peak()

    model = engine.model
    for name, module in [("head", model.lm_head), *((f"layer {i}", m) for i, m in enumerate(model.model.layers))]:
        module.register_forward_pre_hook(lambda _m, _i, n=name: mark(f"forward {n}"))
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            p.register_post_accumulate_grad_hook(lambda _p, n=name: mark(f"gradient {n.removesuffix('.weight')}"))
    engine.optimizer.register_step_pre_hook(lambda *_: mark("optimizer step starts"))
    engine.optimizer.register_step_post_hook(lambda *_: mark("optimizer step ends"))
    _reset_peak()
    sft_step(engine, batch)
    mark("step ends")
    return log


def head_copies(vocab: int, hidden: int, chunk: int, rows: int, with_entropy: bool) -> float:
    import torch

    from rlrecipe.train.logprobs import token_logprobs

    head = torch.nn.Linear(hidden, vocab, bias=False)
    head.weight.grad = torch.zeros_like(head.weight)
    states = torch.randn(rows, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    peak = 0
    for _ in range(2):  # the second pass, allocator warm
        base = _status_kib("VmRSS")
        _reset_peak()
        logp, entropy = token_logprobs(head, states, targets, 1.0, chunk, with_entropy)
        (-logp.mean() + (0.01 * entropy.mean() if with_entropy else 0)).backward()
        peak = _status_kib("VmHWM") - base
        states.grad = None
    return peak * 1024 / (min(chunk, rows) * vocab * 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["step", "head"])
    ap.add_argument("config", nargs="?", help="step: [hidden, intermediate, layers, heads, kv, vocab, tokens, ckpt]")
    args = ap.parse_args()
    if args.what == "step":
        with tempfile.TemporaryDirectory() as tmp:
            previous = "step starts"
            for label, peak in step_phases(tuple(json.loads(args.config)), Path(tmp)):
                print(f"{previous:>36} .. {label:<36} peak {peak:8.1f} MiB")
                previous = label
        return
    for vocab, hidden, chunk, rows in HEAD_SHAPES:
        for with_entropy in (False, True):
            print(f"V {vocab}, hidden {hidden}, chunk {chunk}, {rows} rows, entropy {with_entropy}: "
                  f"{head_copies(vocab, hidden, chunk, rows, with_entropy):.2f} [chunk x V] fp32 copies at the peak "
                  f"(the head's gradient is {hidden * 4 / (chunk * 4):.2f} of one)")


if __name__ == "__main__":
    main()
