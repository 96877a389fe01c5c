"""Synchronous, C3PO++, asynchronous and asynchronous + C3PO++ schedules projected at a recipe's size.

`bench.projection.rollout` times one rollout engine's share of a step (its real pool logic over
`SimEngine`, under the GPU cost model); this module puts those rollout steps and a training-time
model on a cluster of G GPUs and compares four schedules per trained token, on the same G:

- sync, colocated: every GPU rolls out, then every GPU trains, then the weights are pushed; one
  after the other (a step = rollout + train + push).
- sync, split: the recipe as shipped: G_r GPUs serve rollouts, G_t train; still one after the
  other, so each side idles while the other works.
- C3PO++: either of the above, with the rollout step of C3PO++'s budget (Phi per step, partial
  rollouts resumed under new weights).
- async (eta >= 1): separate pools of G_r rollout and G_t training GPUs working at once. The
  rollouts of step k may start once the weights of version k - eta are out (training of step
  k - eta - 1 and its push are done), so a step's rollouts are at most eta versions older than
  the policy that trains on them; `pipeline` runs that schedule over per-step seconds. In steady
  state a step costs max(rollout step + weight load, train step + push), not their sum.
  The rollout side here generates whole steps (as the synchronous or C3PO++ rollout does); it
  does not admit the next step's prompts into a step's tail. G_r is chosen on a node grid to
  balance the two sides.

Training seconds: `CostModel.train_token_s` per trained token on one GPU (the H100 assumption: 8N
FLOP per token, 6N forward and backward and 2N recomputing old log-probs, at 40% of 989 dense
bf16 TFLOP/s), divided over the training GPUs (data parallel, linear), plus `train_step_s` per step
for the optimizer step. The weight push is costed by `bench.projection.push` for every layout with
separate rollout GPUs: the trainer writes the export (its side) and the rollout side pauses until
every server has loaded it (over disk: one shared-file-system read per node, then the page cache);
a synchronous step waits for both, an asynchronous one overlaps them with the other side's work.
Colocated layouts load the weights in place (one load from memory per engine, no file system).

    python -m bench.projection.asynchronous recipes/7b_boba_icepop_c3po.yaml --lognormal 10000,0.4,0.45
    python -m bench.projection.asynchronous recipes/7b_boba_icepop_c3po.yaml --areal bench/data/areal_aime24_lengths.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from bench.projection.push import WEIGHT_BYTES_7B, PushModel, describe, push_cost
from bench.projection.rollout import _steady, gpu_cost_model, lognormal_groups, lognormal_label, recipe_trace
from bench.projection.sim import FEATURES, CostModel, simulate

AREAL_LENGTHS = Path(__file__).parents[1] / "data" / "areal_aime24_lengths.json"
NODE = 8  # GPUs per node: the grid the rollout / training split is chosen on


def pipeline(rollout_s: list[float], train_s: list[float], eta: int) -> list[float]:
    """When each step's training (and push) ends, for rollout steps of `rollout_s` seconds and
    training steps of `train_s` seconds (push included), with staleness at most `eta`.

    Step k's rollouts start when the rollout side is free (step k-1's rollouts are done) and the
    weights of version k - eta exist (step k - eta - 1 has trained and pushed; version 0 exists
    at the start); step k trains when its rollouts are done and the trainer is free. eta = 0 is
    the synchronous schedule: each step's end is the last one's plus rollout plus train."""
    if eta < 0:
        raise ValueError("eta: 0 (synchronous) or more")
    if len(rollout_s) != len(train_s):
        raise ValueError("one rollout and one training time per step")
    rollout_end: list[float] = []
    train_end: list[float] = []
    for k, (r, t) in enumerate(zip(rollout_s, train_s, strict=True)):
        weights_at = train_end[k - eta - 1] if k - eta - 1 >= 0 else 0.0
        start = max(rollout_end[-1] if rollout_end else 0.0, weights_at)
        rollout_end.append(start + r)
        train_end.append(max(train_end[-1] if train_end else 0.0, rollout_end[-1]) + t)
    return train_end


def steady_step_s(rollout_s: list[float], train_s: list[float], eta: int, laps: int = 20) -> float:
    """Seconds per step in steady state: the step sequence repeated `laps` times, the mean step
    over the second half (the pipeline's filling left out)."""
    r, t = rollout_s * laps, train_s * laps
    ends = pipeline(r, t, eta)
    half = len(ends) // 2
    return (ends[-1] - ends[half - 1]) / (len(ends) - half)


# -- lengths ------------------------------------------------------------------------------------
def areal_groups(path: str | Path = AREAL_LENGTHS) -> tuple[list[list[int]], str]:
    """Response lengths logged by AReaL evaluation runs (bench/data/README.md), one list per
    prompt as logged, and a label naming them."""
    data = json.loads(Path(path).read_text())
    groups = [g for run in data["runs"] for g in run["groups"]]
    flat = sorted(x for g in groups for x in g)
    label = (f"REAL: {len(flat)} responses to {len(groups)} AIME24 prompts from AReaL evaluation logs "
             f"({', '.join(sorted({r['model'] for r in data['runs']}))}; {data['sampling']}); "
             f"median {flat[len(flat) // 2]}, mean {sum(flat) / len(flat):.0f}, "
             f"{sum(x >= 12000 for x in flat) / len(flat):.0%} at the 12,000 cut; source: {data['source']}")
    return groups, label


def length_stats(groups: list[list[int]], max_new_tokens: int) -> dict:
    flat = sorted(min(x, max_new_tokens) for g in groups for x in g)
    n = len(flat)
    return {"responses": n, "median": flat[n // 2], "mean": round(sum(flat) / n), "p90": flat[int(0.9 * n)],
            "max": flat[-1]}


# -- one rollout engine's share, for a given number of engines ----------------------------------
def engine_share(loaded, engines: int, *, steps: int, kv_tokens: int | None, prompt_len: int = 256) -> dict:
    """`recipe_trace`'s settings for one of `engines` rollout engines (the recipe's batch, pool and
    budget divided by `engines` instead of its own server count)."""
    rl = loaded.recipe.rl
    trace = recipe_trace(loaded.recipe, steps=steps, prompt_len=prompt_len, kv_tokens=kv_tokens)
    s = trace["settings"]
    prompts = max(1, round(rl.prompts_per_step / engines))
    pool = max(rl.samples_per_prompt, round(rl.c3po.pool_capacity / engines))
    s.update(engines=engines, prompts_per_step=prompts, pool_capacity=pool,
             token_budget=max(1, round(rl.c3po.token_budget / engines)),
             max_batch=max(prompts * rl.samples_per_prompt, pool))
    return trace


def rollout_steps(loaded, engines: int, cost: CostModel, groups: list[list[int]], *, steps: int,
                  kv_tokens: int | None, cache: dict) -> dict[str, list[dict]]:
    """Simulated steady rollout steps of one engine when `engines` share the step (both modes)."""
    if engines not in cache:
        trace = engine_share(loaded, engines, steps=steps, kv_tokens=kv_tokens)
        sim = simulate(trace, cost, groups=groups)
        cache[engines] = {mode: _steady(sim[mode]) for mode in ("sync", "c3po")}
    return cache[engines]


def schedule_row(name: str, steps: list[dict], *, gpus: int, rollout_gpus: int, train_gpus: int, eta: int,
                 colocated: bool, cost: CostModel, push: dict) -> dict:
    """One schedule's steady step on the cluster: rollout seconds are one engine's (all engines run
    alike shares), the step's trained tokens are every engine's, trained over `train_gpus`; `push`
    (push_cost's) adds its trainer side to each training step and its rollout side to each rollout step."""
    rollout = [s["seconds"] + push["rollout_s"] for s in steps]
    tokens = [s["tokens"] * rollout_gpus for s in steps]
    train = [cost.train_token_s * n / train_gpus + cost.train_step_s + push["trainer_s"] for n in tokens]
    step = steady_step_s(rollout, train, eta)
    mean_tokens = sum(tokens) / len(tokens)
    mean_r, mean_t = sum(rollout) / len(rollout), sum(train) / len(train)
    return {"schedule": name, "gpus": gpus, "rollout_gpus": rollout_gpus, "train_gpus": train_gpus,
            "colocated": colocated, "eta": eta, "rollout_s": mean_r, "train_push_s": mean_t, "step_s": step,
            "push_trainer_s": push["trainer_s"], "push_rollout_s": push["rollout_s"],
            "push_transport": push["transport"], "shared_fs_reads_per_step": push.get("shared_fs_reads_per_step", 0),
            "trained_tokens_per_step": mean_tokens, "s_per_1m_trained_tokens": 1e6 * step / mean_tokens,
            # busy share of each side: colocated GPUs do both, one after the other
            "rollout_busy": mean_r / step if not colocated else (mean_r + mean_t) / step,
            "train_busy": mean_t / step if not colocated else (mean_r + mean_t) / step}


@dataclass(frozen=True)
class Cluster:
    """The recipe's GPUs as the projection lays them out: the shipped rollout and training GPUs, the KV
    cache of one engine (`rlrecipe plan`'s), and the weight sync the recipe ships with."""

    loaded: object
    kv: int
    shipped_r: int
    shipped_t: int
    transport: str

    @property
    def gpus(self) -> int:
        return self.shipped_r + self.shipped_t

    @classmethod
    def of(cls, loaded) -> Cluster:
        from rlrecipe.checks.plan import kv_cache_tokens, rollout_engines

        recipe = loaded.recipe
        return cls(loaded, kv_cache_tokens(loaded), rollout_engines(recipe) * recipe.rollout.sglang.tp_size,
                   recipe.trainer.nproc * recipe.trainer.nodes,
                   "broadcast" if recipe.rollout.sglang.weight_sync == "distributed" else "disk")


# Simulated rollout steps by (recipe, overrides, steps, rollout cost, lengths): the simulator is
# deterministic, so calls that differ only in the training model, the push or the layouts compared
# (async_fast's push variants, colocated's phase-cost variants, both on the same lengths) share them.
_SIMULATED: dict[tuple, dict] = {}


def simulation_cache(recipe_path, overrides: list[str] | None, steps: int, cost: CostModel,
                     groups: list[list[int]]) -> dict:
    """The process's cache of simulated rollout steps (by engine count) for these inputs."""
    rollout_cost = tuple(getattr(cost, f) for f in FEATURES)
    key = (str(recipe_path), tuple(overrides or ()), steps, rollout_cost, tuple(tuple(g) for g in groups))
    return _SIMULATED.setdefault(key, {})


def async_projection(recipe_path: str | Path, groups: list[list[int]], *, lengths_label: str = "",
                     etas: tuple[int, ...] = (1, 2), steps: int = 5, cost: CostModel | None = None,
                     cost_name: str = "", load_s: float | None = None, train_scale: float = 1.0,
                     push_model: PushModel = PushModel(), per_node: bool = True, weight_bytes: float = WEIGHT_BYTES_7B,
                     splits: tuple[int, ...] | None = None, overrides: list[str] | None = None,
                     cache: dict | None = None, colocated_phases: dict[str, float] | None = None) -> dict:
    """The four schedules (and sync / C3PO++ both colocated and split as shipped) on the recipe's own
    GPU count, batch and C3PO++ settings, over response lengths `groups` (one list per prompt).

    Returns {"assumptions": ..., "rows": [...]}: per schedule the GPUs of each side, eta, rollout and
    train + push seconds per step, the steady step, trained tokens per step and seconds per million
    trained tokens, and speed-ups per trained token against both synchronous layouts.
    `splits`: rollout GPU counts to try for async (default: the node grid around the balance).
    `cache`: simulated rollout steps by engine count, shared by calls that differ only in the
    training model (`train_scale`, `load_s`, `etas`, the push); default: the process's
    (`simulation_cache`).
    `colocated_phases`: seconds of a colocated step's phase changes (bench.projection.colocated), which
    add the rows "sync, colocated, costed" and "C3PO++, colocated, costed" in their place of the
    idealised rows' in-place load.
    The push (`bench.projection.push`): over the recipe's transport (disk at eta >= 2), `per_node`
    loading as sglang/weights.py does; `load_s`, when given, replaces the modelled rollout-side pause of
    every layout with separate rollout GPUs (the sensitivity to the push)."""
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(str(recipe_path), overrides or [])
    if cost is None:
        cost, cost_name = gpu_cost_model()
    cost = replace(cost, train_token_s=cost.train_token_s * train_scale)
    c = Cluster.of(loaded)
    if cache is None:
        cache = simulation_cache(recipe_path, overrides, steps, cost, groups)
    sim = lambda n: rollout_steps(loaded, n, cost, groups, steps=steps, kv_tokens=c.kv, cache=cache)  # noqa: E731

    def push(servers: int, eta: int) -> dict:
        transport = "disk" if eta >= 2 else c.transport  # a copy held for later is an export
        out = push_cost(transport, weight_bytes, servers, per_node=per_node, model=push_model)
        return out if load_s is None else {**out, "rollout_s": load_s, "modelled_rollout_s": out["rollout_s"]}

    in_place = {"transport": "in place", "trainer_s": 0.0, "rollout_s": weight_bytes / push_model.load_bps}
    rows = synchronous_rows(c, sim, cost, in_place, push(c.shipped_r, 0), colocated_phases)
    if splits is None:
        splits = balanced_splits(sim(c.shipped_r), c.shipped_r, c.gpus, cost)
    rows += asynchronous_rows(c, sim, cost, push, etas, splits)
    add_speedups(rows)
    return {"assumptions": assumptions(recipe_path, c, groups, splits=splits, cost=cost, cost_name=cost_name,
                                       lengths_label=lengths_label, train_scale=train_scale, steps=steps,
                                       push_model=push_model, per_node=per_node, load_s=load_s),
            "rows": rows}


def synchronous_rows(c: Cluster, sim, cost: CostModel, in_place: dict, split_push: dict,
                     colocated_phases: dict[str, float] | None) -> list[dict]:
    """Sync and C3PO++, colocated (weights loaded in place) and split as shipped (`split_push`), and
    with `colocated_phases` the colocated rows with every phase change costed."""
    rows = []
    for mode, label in (("sync", "sync"), ("c3po", "C3PO++")):
        rows.append(schedule_row(f"{label}, colocated", sim(c.gpus)[mode], gpus=c.gpus, rollout_gpus=c.gpus,
                                 train_gpus=c.gpus, eta=0, colocated=True, cost=cost, push=in_place))
        rows.append(schedule_row(f"{label}, split as shipped", sim(c.shipped_r)[mode], gpus=c.gpus,
                                 rollout_gpus=c.shipped_r, train_gpus=c.shipped_t, eta=0, colocated=False, cost=cost,
                                 push=split_push))
    if colocated_phases is not None:
        costed = {"transport": "in place, phases costed", "trainer_s": sum(colocated_phases.values()),
                  "rollout_s": 0.0}
        for mode, label in (("sync", "sync"), ("c3po", "C3PO++")):
            rows.append(schedule_row(f"{label}, colocated, costed", sim(c.gpus)[mode], gpus=c.gpus,
                                     rollout_gpus=c.gpus, train_gpus=c.gpus, eta=0, colocated=True, cost=cost,
                                     push=costed))
    return rows


def asynchronous_rows(c: Cluster, sim, cost: CostModel, push, etas: tuple[int, ...],
                      splits: tuple[int, ...]) -> list[dict]:
    """Async and async + C3PO++ at each eta, each at the split among `splits` with the fewest seconds
    per trained token."""
    rows = []
    for mode, label in (("sync", "async"), ("c3po", "async + C3PO++")):
        for eta in etas:
            best = min((schedule_row(f"{label}, eta={eta}", sim(r)[mode], gpus=c.gpus, rollout_gpus=r,
                                     train_gpus=c.gpus - r, eta=eta, colocated=False, cost=cost, push=push(r, eta))
                        for r in splits), key=lambda row: row["s_per_1m_trained_tokens"])
            rows.append(best)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's speed-up per trained token against sync colocated and sync split as shipped."""
    base = {k: next(r for r in rows if r["schedule"] == f"sync, {k}")["s_per_1m_trained_tokens"]
            for k in ("colocated", "split as shipped")}
    for r in rows:
        r["speedup_vs_sync_colocated"] = base["colocated"] / r["s_per_1m_trained_tokens"]
        r["speedup_vs_sync_split"] = base["split as shipped"] / r["s_per_1m_trained_tokens"]


def assumptions(recipe_path, c: Cluster, groups: list[list[int]], *, splits, cost: CostModel, cost_name: str,
                lengths_label: str, train_scale: float, steps: int, push_model: PushModel, per_node: bool,
                load_s: float | None) -> dict:
    """What a projection took as given, written beside its rows."""
    recipe = c.loaded.recipe
    rl = recipe.rl
    return {
        "recipe": str(recipe_path), "gpus": c.gpus,
        "shipped_split": f"{c.shipped_r} rollout (SGLang, tp {recipe.rollout.sglang.tp_size}) + {c.shipped_t} training",
        "batch": f"{rl.prompts_per_step} prompts x {rl.samples_per_prompt}, max_new_tokens "
                 f"{recipe.rollout.max_new_tokens}; per engine: the batch, pool ({rl.c3po.pool_capacity}) and "
                 f"budget ({rl.c3po.token_budget}) divided by the rollout GPUs, rounded to whole prompts",
        "kv_tokens_per_engine": c.kv,
        "lengths": lengths_label, "length_stats": length_stats(groups, recipe.rollout.max_new_tokens),
        "cost_model": cost_name or cost.label,
        "train": f"{cost.train_token_s * 1e6:.0f} us per trained token on one GPU (x{train_scale:g} of the cost "
                 f"model's), linear over the training GPUs, + {cost.train_step_s:g} s per step (optimizer step "
                 f"and weight push)",
        "async": f"step k's rollouts start once version k - eta is pushed; split chosen among {list(splits)} "
                 f"rollout GPUs",
        "push": {**describe(push_model), "transport": f"{c.transport} (the recipe's), disk at eta >= 2",
                 "per_node": per_node, "rollout_pause_override_s": load_s,
                 "colocated": "in place: one load from memory per engine, nothing on the file system",
                 "train_step_s": "the optimizer step alone; the push is added on its own"},
        "steps": f"{steps} simulated steps per engine share after a warm-up step, repeated to steady state",
    }


def balanced_splits(shipped: dict[str, list[dict]], shipped_r: int, gpus: int, cost: CostModel) -> tuple[int, ...]:
    """Rollout GPU counts (on the node grid) around the split where rollout and training take equally
    long, from the shipped split's per-GPU rates (seconds of one GPU per trained token)."""
    out = set()
    for mode in ("sync", "c3po"):
        st = shipped[mode]
        rollout_rate = sum(s["seconds"] for s in st) / sum(s["tokens"] for s in st)  # one engine: s per token
        share = rollout_rate / (rollout_rate + cost.train_token_s)
        centre = round(share * gpus / NODE) * NODE
        out.update(r for r in (centre - NODE, centre, centre + NODE) if NODE <= r <= gpus - NODE)
    out.add(shipped_r)
    return tuple(sorted(out))


def markdown(result: dict) -> str:
    """The rows as a Markdown table."""
    head = ("| schedule | rollout + train GPUs | η | rollout s / step | train + push s / step | step s | "
            "trained tokens / step | s per 1M trained tokens | vs sync colocated | vs sync split |")
    lines = [head, "|" + "---|" * 10]
    for r in result["rows"]:
        gpus = f"{r['gpus']} (both)" if r["colocated"] else f"{r['rollout_gpus']} + {r['train_gpus']}"
        lines.append(f"| {r['schedule']} | {gpus} | {r['eta']} | {r['rollout_s']:.0f} | {r['train_push_s']:.0f} | "
                     f"{r['step_s']:.0f} | {r['trained_tokens_per_step'] / 1e6:.1f}M | "
                     f"{r['s_per_1m_trained_tokens']:.2f} | {r['speedup_vs_sync_colocated']:.2f}× | "
                     f"{r['speedup_vs_sync_split']:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe", help="an RL recipe with SGLang rollout servers (e.g. recipes/7b_boba_icepop_c3po.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    lengths = ap.add_mutually_exclusive_group(required=True)
    lengths.add_argument("--lognormal", metavar="MEDIAN,PROMPT_SIGMA,SAMPLE_SIGMA",
                         help="assumed log-normal response lengths (bench.projection.rollout.lognormal_groups)")
    lengths.add_argument("--areal", nargs="?", const=str(AREAL_LENGTHS), metavar="JSON",
                         help=f"real response lengths from AReaL evaluation logs (default {AREAL_LENGTHS})")
    lengths.add_argument("--lengths", help="JSON list of lists of response lengths, one list per prompt")
    ap.add_argument("--eta", default="1,2", help="staleness bounds to project async at (comma-separated)")
    ap.add_argument("--steps", type=int, default=5, help="simulated steps per engine share")
    ap.add_argument("--splits", help="rollout GPU counts to try for async (default: node grid around the balance)")
    ap.add_argument("--cost", help="cost model JSON (CostModel fields); default: bench/cost_model.json or the H100 "
                                   "assumption")
    ap.add_argument("--load-s", type=float, default=None,
                    help="seconds the rollout side pauses per push, in place of the push model's (sensitivity)")
    ap.add_argument("--every-server-reads", action="store_true",
                    help="disk push without the per-node load: every server reads the shared file system")
    ap.add_argument("--train-scale", default="1",
                    help="multiply the training seconds per token (e.g. 1.25: gradient checkpointing's extra "
                         "forward); comma-separated for several tables over the same simulated rollouts")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    from rlrecipe.recipe.schema import load_recipe

    max_new = load_recipe(args.recipe, args.set).recipe.rollout.max_new_tokens
    samples = load_recipe(args.recipe, args.set).recipe.rl.samples_per_prompt
    if args.lognormal:
        median, prompt_sigma, sample_sigma = (float(x) for x in args.lognormal.split(","))
        groups = lognormal_groups(median, prompt_sigma, sample_sigma, samples, max_new)
        label = lognormal_label(median, prompt_sigma, sample_sigma, max_new)
    elif args.areal:
        groups, label = areal_groups(args.areal)
    else:
        groups, label = json.loads(Path(args.lengths).read_text()), f"from {args.lengths}"
    cost, cost_name = (CostModel.from_json(args.cost), args.cost) if args.cost else gpu_cost_model()
    cache: dict = {}
    results = []
    for scale in (float(x) for x in args.train_scale.split(",")):
        result = async_projection(args.recipe, groups, lengths_label=label,
                                  etas=tuple(int(x) for x in args.eta.split(",")), steps=args.steps, cost=cost,
                                  cost_name=cost_name, load_s=args.load_s, train_scale=scale,
                                  per_node=not args.every_server_reads,
                                  splits=tuple(int(x) for x in args.splits.split(",")) if args.splits else None,
                                  overrides=args.set, cache=cache)
        print(json.dumps(result["assumptions"], indent=2))
        print(markdown(result))
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    return results[0] if len(results) == 1 else {"tables": results}


if __name__ == "__main__":
    main()
