"""What an FP8 KV cache (rollout.kv_cache_dtype: fp8_e4m3) does at 7B: the decode bound and the step,
beside the bf16 cache, on the shipped 7B recipes as they are laid out (64 SGLang servers of tp 1,
64 DeepSpeed ranks).

The closed forms `rlrecipe fit` ranks layouts by (rlrecipe/checks/step_time.py, H100 rates, the
assumed log-normal lengths): one byte a cached element instead of two halves what a decoding step
reads per context token (Rates.ctx_s) and doubles the tokens the same pool holds
(`rlrecipe.checks.plan.sglang_memory`), so twice the rows decode at once over the same weights read.
Training does not change. Scales, FP8 attention kernels and any accuracy cost are outside it: a
projection of bytes, not a measurement.

    python -m bench.projection.fp8_kv      # prints the keys as JSON, then the table
"""

from __future__ import annotations

import json
import math

RECIPES = ("recipes/7b_boba.yaml", "recipes/7b_boba_icepop_c3po.yaml")
ARMS = (("bf16", "auto"), ("fp8", "fp8_e4m3"))


def arm(recipe_path: str, kv_cache_dtype: str) -> dict[str, float]:
    """One recipe with one KV cache dtype: its KV bytes, cache, decode bound, rollout, training and step."""
    from rlrecipe.checks.model_dims import kv_bytes, model_dims
    from rlrecipe.checks.plan import rollout_engines, sglang_memory
    from rlrecipe.checks.step_time import Lengths, Rates, rollout_step, tp_efficiency, training_step
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe_path, [f"rollout.kv_cache_dtype={kv_cache_dtype}"])
    r, d = loaded.recipe, model_dims(loaded)
    ro, tr, rl = r.rollout, r.trainer, r.rl
    lengths = Lengths.assumed(ro.max_new_tokens, r.data.max_prompt_tokens)
    rates = Rates.of(d, ro.dtype, r.model.gradient_checkpointing, train_seq_len=lengths.sequence,
                     kv_bytes=kv_bytes(ro))
    _, _, kv, kv_token = sglang_memory(r, d)
    kv_tokens = int(kv // kv_token)
    tp = ro.sglang.tp_size
    rollouts = rl.prompts_per_step * rl.samples_per_prompt
    rollout = rollout_step(rates, lengths, engines=rollout_engines(r), tp=tp, kv_tokens=kv_tokens, rollouts=rollouts,
                           max_concurrency=ro.sglang.max_concurrency,
                           c3po_budget=rl.c3po.token_budget if rl.c3po.enabled else None,
                           c3po_pool=rl.c3po.pool_capacity)
    train = training_step(rates, d, trained_tokens=rollout.trained_tokens, ranks=tr.nproc * tr.nodes, nodes=tr.nodes,
                          dtype=r.model.dtype, zero_stage=tr.zero_stage, offload_optimizer=tr.offload_optimizer,
                          offload_params=tr.offload_params, microbatch_tokens=tr.max_tokens_per_microbatch,
                          chunk_tokens=tr.logprob_chunk_tokens, minibatches=rl.ppo_minibatches)
    # The decode bound with the cache full: rows at their mean size (prompt + half the response) fill
    # it; each step reads the weights once and the whole cache once and yields one token a row.
    occupancy = lengths.prompt + lengths.mean / 2
    rows = max(1, math.floor(kv_tokens / occupancy))
    per_token = (rates.step_s + rates.ctx_s * rows * occupancy) / rows + rates.row_s
    gpu_per_token = per_token * tp / (tp * tp_efficiency(tp))  # GPU-seconds of a tp engine per token
    step = rollout.seconds + train.seconds
    return {"kv_bytes_per_token": kv_token * tp, "kv_tokens_per_engine": kv_tokens, "rows_cache_full": rows,
            "decode_us_per_token_per_gpu": gpu_per_token * 1e6,
            "decode_weights_us_per_token": rates.step_s / rows * 1e6,
            "decode_kv_us_per_token": rates.ctx_s * occupancy * 1e6, "decode_rows_us_per_token": rates.row_s * 1e6,
            "rows_at_once": rollout.rows_at_once, "rollout_s": rollout.seconds, "train_s": train.seconds,
            "step_s": step, "trained_tokens": rollout.trained_tokens,
            "s_per_mtoken": step / rollout.trained_tokens * 1e6}


def fp8_projection() -> dict:
    """The keys `make bench` would write under `fp8_kv_projection_7b`: per recipe and arm, and FP8 against bf16."""
    out: dict = {}
    for path in RECIPES:
        name = path.rsplit("/", 1)[-1].removesuffix(".yaml")
        arms = {label: arm(path, dtype) for label, dtype in ARMS}
        for label, values in arms.items():
            out.update({f"{name}_{label}_{k}": v for k, v in values.items()})
        out[f"{name}_fp8_decode_speedup"] = (arms["bf16"]["decode_us_per_token_per_gpu"]
                                             / arms["fp8"]["decode_us_per_token_per_gpu"])
        out[f"{name}_fp8_rollout_speedup"] = arms["bf16"]["rollout_s"] / arms["fp8"]["rollout_s"]
        out[f"{name}_fp8_step_speedup_per_trained_token"] = arms["bf16"]["s_per_mtoken"] / arms["fp8"]["s_per_mtoken"]
    out["assumptions"] = ("rlrecipe/checks/step_time.py's H100 rates and log-normal lengths; the recipes' own "
                          "layouts; FP8 = 1 byte a cached element, nothing else changed (kernels, scales, accuracy)")
    return out


def markdown(result: dict) -> str:
    lines = ["| recipe | KV | bytes / token | KV tokens / server | rows, cache full | decode µs / token / GPU "
             "(weights + KV + rows) | rollout s | train s | step s | s / 1M trained tokens |", "|" + "---|" * 10]
    for path in RECIPES:
        name = path.rsplit("/", 1)[-1].removesuffix(".yaml")
        for label, _ in ARMS:
            g = lambda k, p=f"{name}_{label}_": result[p + k]  # noqa: E731
            lines.append(f"| {name} | {label} | {g('kv_bytes_per_token'):,.0f} | {g('kv_tokens_per_engine'):,} | "
                         f"{g('rows_cache_full')} | {g('decode_us_per_token_per_gpu'):.0f} "
                         f"({g('decode_weights_us_per_token'):.0f} + {g('decode_kv_us_per_token'):.0f} + "
                         f"{g('decode_rows_us_per_token'):.0f}) | {g('rollout_s'):,.0f} | {g('train_s'):,.0f} | "
                         f"{g('step_s'):,.0f} | {g('s_per_mtoken'):.1f} |")
        lines.append(f"| {name} | fp8 vs bf16 | | | | {result[f'{name}_fp8_decode_speedup']:.2f}× | "
                     f"{result[f'{name}_fp8_rollout_speedup']:.2f}× | | | "
                     f"{result[f'{name}_fp8_step_speedup_per_trained_token']:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = fp8_projection()
    print(json.dumps(res, indent=2, default=str))
    print(markdown(res))
