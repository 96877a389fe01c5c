"""The 7B micro-batch's measured GPU peak (bench.logprob_memory --model 7b --json F) beside the plan's.

  python -m bench.plan_7b_gpu runs/gpu-checks/logprob_7b.json     # `make gpu-checks` runs it
  python -m bench.plan_7b_gpu bench/gpu/logprob_7b_h100.json       # the H100 figures kept in the repo

logprob_memory measures, above the weights, forward and backward of a packed micro-batch's
log-probs in bfloat16 on one GPU (R1-Distill-Qwen-7B's shapes, gradient checkpointing, 4
documents). The plan describes a micro-batch that runs beside the step's whole gradients (a step
accumulates over many), so the points compared are the attention sweep's, whose peak is a second
forward and backward beside the first one's gradients. The first sweep's single pass, which starts
with no gradients, is a different step and is not compared. The plan's terms for the same thing
(plan.train_budget in one process, no ZeRO): the gradients and the micro-batch's phases up to the
embedding's gradient (no optimizer step runs). The ratio is printed as it comes; nothing is fitted.
"""

from __future__ import annotations

import argparse
import json

MIB = 2**20
TERMS = ("gradients", "activations", "log-probs", "layer backward", "embedding grad")


def compare(result: dict) -> list[dict]:
    sweeps = result.get("attention", {"": result})  # bench/gpu/logprob_7b_h100.json keeps one per attention
    rows = []
    for result in sweeps.values():
        rows += _compare_sweep(result)
    return rows


def _compare_sweep(result: dict) -> list[dict]:
    from bench.logprob_memory import SHAPES, VOCAB
    from rlrecipe.checks.model_dims import ModelDims
    from rlrecipe.checks.plan import train_budget
    from rlrecipe.recipe.schema import recipe_from_dict

    h, inter, layers, heads, kv = SHAPES[result["shape"]]
    dims = ModelDims(VOCAB, h, inter, layers, heads, kv, tied=False)
    rows = []
    for p in result["points"]:
        if p["path"] != "chunked" or p.get("oom"):
            continue
        recipe = recipe_from_dict({"run": {"name": "b"}, "model": {"tiny": {}, "gradient_checkpointing": True,
                                                                   "dtype": "bfloat16"},
                                   "trainer": {"engine": "torch", "max_tokens_per_microbatch": p["tokens"],
                                               "logprob_chunk_tokens": result["chunk_tokens"]}})
        parts = train_budget(recipe, dims).parts
        predicted = sum(parts[t] for t in TERMS) / MIB
        rows.append({"tokens": p["tokens"], "attn": p.get("attn"), "measured_mib": p["peak_mib"],
                     "predicted_mib": round(predicted, 1), "predicted_over_measured": round(predicted / p["peak_mib"], 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json_files", nargs="+")
    args = ap.parse_args()
    for f in args.json_files:
        with open(f) as fh:
            for row in compare(json.load(fh)):
                print(json.dumps({"file": f, **row}))


if __name__ == "__main__":
    main()
