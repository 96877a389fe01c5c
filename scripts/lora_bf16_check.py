"""A bfloat16 LoRA RL run scored by each route its weights can take, on the run's own held-out set.

Routes (every one sampled by the in-process engine with the run's eval settings and seed, as
`rlrecipe eval` samples; the engine computes in rollout.dtype):

  a_unmerged     what was trained: the bfloat16 base with the adapter applied unmerged (PEFT's
                 layers, the adapter in float32), as the trainer scores it and as SGLang serves a
                 base + adapter
  a_fp32         route a computed in float32 (the same bfloat16 base values, widened): set beside
                 b_fp32, it isolates the merge from the compute dtype
  b_eval         final/ (the float32 merge) loaded as `rlrecipe eval` loads it: at rollout.dtype
  b_fp32         final/ loaded in float32: the float32 merge computed in float32
  c_old_merge    the merge as it was before the float32 merge: W_bf16 + bf16(delta), summed in bfloat16

Besides avg@n and pass@k per route, it prints the teacher-forced log-probs of a few held-out
prompts' responses (route a's greedy and sampled ones) under each route against route a, and
against the trainer's own scoring of route a (TorchTrainEngine, its attention kernel); and, per
wrapped weight, how much of the update each bfloat16 merge keeps.

    python -m scripts.lora_bf16_check runs/lora-bf16-check [--routes a_unmerged,b_fp32,c_old_merge]
        [--prompts 8] [--out DIR]

Run it from the directory the run's recipe paths are relative to (the repository root).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rlrecipe.eval.runner import evaluate_benchmarks

from rlrecipe.data.io import load_rows
from rlrecipe.data.templates import row_prompt_ids
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.schema import load_recipe
from rlrecipe.reward import Grader
from rlrecipe.rollout.base import SEED_KEY
from rlrecipe.rollout.inprocess import InProcessEngine
from rlrecipe.run.record import resolve_init
from rlrecipe.train import lora
from rlrecipe.trajectory.record import SamplingParams, Trajectory

ROUTES = ("a_unmerged", "a_fp32", "b_eval", "b_fp32", "c_old_merge")
# pairs compared token by token besides every route against a (a_trainer: the trainer's own scoring of a)
PAIRS = [("a_fp32", "b_fp32"), ("b_eval", "c_old_merge")]


def engine_for(model_dir: Path, tokenizer, recipe, dtype: str) -> InProcessEngine:
    ro = recipe.rollout
    return InProcessEngine(model_dir, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           dtype=dtype, max_batch=ro.max_batch, refill_fraction=ro.refill_fraction,
                           kv_cache_dtype=ro.kv_cache_dtype, kv_scales=ro.kv_scales)


def with_adapter(engine: InProcessEngine, section, adapter_dir: Path):
    """The engine's own model, its linear layers wrapped in place by PEFT and the trained adapter loaded."""
    peft_model = lora.wrap(engine.model, section)
    lora.load_adapter_into(peft_model, adapter_dir)
    peft_model.eval()
    assert peft_model.get_base_model() is engine.model
    return peft_model


@torch.no_grad()
def old_merge(peft_model) -> dict[str, torch.Tensor]:
    """The merge before the float32 one: W + delta.to(W.dtype), summed in W's dtype."""
    deltas = {f"{name}.weight": layer.get_delta_weight(lora.ADAPTER_NAME) for name, layer in lora._lora_layers(peft_model)}
    out = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        if key in deltas:
            out[key] = value.detach() + deltas[key].to(value.dtype)
    return out


@torch.no_grad()
def update_kept(peft_model, dtype: torch.dtype) -> dict[str, float]:
    """Over all wrapped weights: |delta| / |W|, and for the merge rounded to `dtype` once (b_eval) and
    summed in it (c_old_merge), the error of the rounded merge less the base against delta, relative."""
    num = {"single": 0.0, "old": 0.0}
    dd = ww = 0.0
    for _, layer in lora._lora_layers(peft_model):
        w = layer.get_base_layer().weight.detach()
        d = layer.get_delta_weight(lora.ADAPTER_NAME).float()
        single = (w.float() + d).to(dtype).float() - w.float()
        old = (w + d.to(w.dtype)).float() - w.float()
        num["single"] += float(((single - d) ** 2).sum())
        num["old"] += float(((old - d) ** 2).sum())
        dd += float((d ** 2).sum())
        ww += float((w.float() ** 2).sum())
    return {"delta_over_w": (dd / ww) ** 0.5, "single_round_off": (num["single"] / dd) ** 0.5,
            "old_merge_off": (num["old"] / dd) ** 0.5}


def forced_sequences(engine, tokenizer, recipe, rows: list[dict], seed: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids, response start) for each row: route a's greedy response and one sampled
    at the eval's temperature and top_p."""
    ev = recipe.eval
    prompts = [row_prompt_ids(tokenizer, r, recipe.data.eval_prompt_template, key="problem") for r in rows]
    out = []
    for params in (SamplingParams(max_new_tokens=ev.max_new_tokens, greedy=True),
                   SamplingParams(temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=ev.max_new_tokens)):
        trajs = [Trajectory(uid=f"{r['id']}#f", prompt_ids=p, group_id=str(r["id"]), answers=[str(r["answer"])],
                            meta={SEED_KEY: seed + i}) for i, (r, p) in enumerate(zip(rows, prompts, strict=True))]
        engine.generate(trajs, params, seed=seed)
        out += [(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]
    return out


def forced_logps(engine: InProcessEngine, seqs) -> list[torch.Tensor]:
    return [torch.tensor(engine.prompt_logprobs(ids))[start - 1:] for ids, start in seqs]


def trainer_logps(base: Path, recipe, adapter_dir: Path, seqs) -> list[torch.Tensor]:
    """Route a as the trainer scores it: TorchTrainEngine on the base at model.dtype, the adapter loaded."""
    from rlrecipe.train.base import TrainSample
    from rlrecipe.train.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine(base, recipe.trainer, 1, dtype=recipe.model.dtype, temperature=1.0,
                           attn_implementation=recipe.model.attn_implementation)
    lora.load_adapter_into(eng.model, adapter_dir)
    return [lp.float() for lp, _ in eng.compute_logprobs([TrainSample(input_ids=ids, start=s) for ids, s in seqs])]


def compare(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, float]:
    diff = torch.cat([(a - b).abs() for a, b in zip(ref, other, strict=True)])
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "over_1e-2": float((diff > 1e-2).float().mean()), "tokens": diff.numel()}


def paired(out: Path, ref: str, route: str, bench: str) -> dict[str, float]:
    """Sample by sample against route `ref` (same seeds): identical responses, verdicts that differ,
    and the mean per-problem accuracy difference with its standard error."""
    read = lambda r: {x["sample"]: x for x in map(json.loads, (out / r / bench / "samples.jsonl").open())}  # noqa: E731
    a, b = read(ref), read(route)
    same = sum(a[k]["response"] == b[k]["response"] for k in a)
    flips = sum(bool(a[k]["correct"]) != bool(b[k]["correct"]) for k in a)
    per: dict[str, list[float]] = {}
    for k in a:
        per.setdefault(a[k]["id"], []).append(float(bool(b[k]["correct"])) - float(bool(a[k]["correct"])))
    d = [sum(v) / len(v) for v in per.values()]
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return {"identical_responses": same / len(a), "verdicts_differ": flips / len(a), "avg_diff": mean, "avg_diff_se": se}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for the teacher-forced comparison")
    ap.add_argument("--out", type=Path, help="where each route's samples and summary go (default RUN/routes)")
    args = ap.parse_args()

    loaded = load_recipe(args.run / "recipe.yaml")
    recipe = loaded.recipe
    base = Path(resolve_init(recipe.run.init_from, recipe.run.output_dir))
    final = args.run / "final"
    adapter_dir = final / lora.ADAPTER_DIR
    out = args.out or args.run / "routes"
    tokenizer = load_tokenizer(final)
    dtype = recipe.rollout.dtype
    rows = load_rows(recipe.eval.benchmarks[0].path, "eval")[: args.prompts]
    print(f"base {base} at {recipe.model.dtype}, adapter {adapter_dir}, engine dtype {dtype}, "
          f"eval n={recipe.eval.n_samples} T={recipe.eval.temperature} top_p={recipe.eval.top_p} seed={recipe.run.seed}")

    def build(route: str):
        if route == "b_eval":
            return engine_for(final, tokenizer, recipe, dtype), None
        if route == "b_fp32":
            return engine_for(final, tokenizer, recipe, "float32"), None
        if route == "a_fp32":
            eng = engine_for(base, tokenizer, recipe, "float32")
            with torch.no_grad():  # the base as the run held it: every tensor rounded to model.dtype
                for t in eng.model.state_dict().values():
                    if t.is_floating_point():
                        t.copy_(t.to(getattr(torch, recipe.model.dtype)).float())
            return eng, with_adapter(eng, recipe.trainer.lora, adapter_dir)
        eng = engine_for(base, tokenizer, recipe, recipe.model.dtype)
        peft_model = with_adapter(eng, recipe.trainer.lora, adapter_dir)
        if route == "a_unmerged":
            return eng, peft_model
        merged = old_merge(peft_model)  # c_old_merge: a fresh base with the old merge pushed in
        eng = engine_for(base, tokenizer, recipe, recipe.model.dtype)
        eng.update_weights_from_state(merged, version=1)
        eng.verify_push(1, state_dict=merged)
        return eng, None

    eng_a, peft_a = build("a_unmerged")
    print("update kept by a bfloat16 merge:", json.dumps(update_kept(peft_a, getattr(torch, dtype))))
    seqs = forced_sequences(eng_a, tokenizer, recipe, rows, recipe.run.seed)
    logps = {"a_unmerged": forced_logps(eng_a, seqs)}
    eng_a.close()
    logps["a_trainer"] = trainer_logps(base, recipe, adapter_dir, seqs)
    results = {}
    for route in args.routes.split(","):
        eng, _ = build(route)
        if route not in logps:
            logps[route] = forced_logps(eng, seqs)
        t0 = time.time()
        with Grader(timeout=2.0) as grader:
            s = evaluate_benchmarks(recipe, eng, tokenizer, grader, out_dir=out / route, model=f"{args.run}:{route}",
                                    recipe_path=loaded.path, recipe_sha256=loaded.sha256, resume=True)
        eng.close()
        s = next(iter(s.values()))
        results[route] = {"avg": s["avg"], "stderr": s["stderr"], "pass_at_k": s["pass_at_k"],
                          "num_correct": s["num_correct"], "seconds": round(time.time() - t0, 1)}
        print(route, json.dumps(results[route]))
    bench = recipe.eval.benchmarks[0].name
    if "a_unmerged" in results:
        for route in results:
            if route != "a_unmerged":
                results[route]["paired_vs_a"] = paired(out, "a_unmerged", route, bench)
                print(f"  {route} vs a_unmerged, sample by sample:", json.dumps(results[route]["paired_vs_a"]))
    print(f"teacher-forced log-probs, {len(seqs)} responses of {len(rows)} held-out prompts (greedy + sampled by a):")
    pairs = [(r, "a_unmerged") for r in logps if r != "a_unmerged"] + [p for p in PAIRS if p[1] != "a_unmerged"]
    forced = {}
    for x, y in pairs:
        if x in logps and y in logps:
            forced[f"{x} vs {y}"] = compare(logps[y], logps[x])
            print(f"  |{x} - {y}|", json.dumps(forced[f"{x} vs {y}"]))
    (out / "routes.json").write_text(json.dumps({"eval": results, "logp": forced}, indent=2))


if __name__ == "__main__":
    main()
