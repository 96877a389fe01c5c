"""`make bench`'s colocated projection at 7B: C3PO++ on the recipe's 128 GPUs shared by training and
rollout, every phase change costed, beside the shipped split, the idealised colocated row and the
async rows of bench.projection.async_fast.

The phase changes (release, reload, offload, resume, push in place, verification) come from
rlrecipe/checks/colocate.py, the same assumptions `rlrecipe fit` ranks colocated layouts by; each is
an assumption (that module says how to measure it). The training itself is the projection's cost model
(bench.projection.asynchronous). The sensitivity table scales one assumption at a time.

The goal it is read against: colocated C3PO++ at >= 2.27x the shipped split per trained token (the
figure AReaL v0.3 measured for its asynchronous mode at 7B). Reported, never tuned toward.

    python -m bench.projection.colocated      # prints the keys as JSON, then the tables
"""

from __future__ import annotations

import json

from bench.projection.async_fast import AREAL_GOAL, LOGNORMAL, STEPS, SYNC_RECIPE
from bench.projection.asynchronous import AREAL_LENGTHS, areal_groups, async_projection
from bench.projection.rollout import lognormal_groups
from rlrecipe.checks.colocate import ASSUMED, PhaseCosts, describe, phase_seconds

# One assumption scaled at a time: (label, key, PhaseCosts.scaled factors); > 1 is slower.
SENSITIVITY = (("push 0.5x", "push0.5x_", {"push_bytes_s": 0.5}), ("push 2x", "push2x_", {"push_bytes_s": 2}),
               ("push 4x", "push4x_", {"push_bytes_s": 4}),
               ("offload 10 GB/s", "offload10_", {"offload_bytes_s": 2}),
               ("offload 5 GB/s", "offload5_", {"offload_bytes_s": 4}),
               ("release, resume 5x", "release5x_", {"release_s": 5, "resume_s": 5}),
               ("verify 10x", "verify10x_", {"verify_s": 10}),
               ("all 4x", "all4x_", {"push_bytes_s": 4, "offload_bytes_s": 4, "release_s": 4, "resume_s": 4,
                                     "verify_s": 4}))


def recipe_phases(recipe_path: str = SYNC_RECIPE, costs: PhaseCosts = ASSUMED) -> dict[str, float]:
    """The phase changes of the recipe's colocated step, on all its GPUs (trainer ranks + servers')."""
    from rlrecipe.checks.model_dims import model_dims
    from rlrecipe.checks.plan import rollout_engines
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe_path)
    r = loaded.recipe
    gpus = r.trainer.nproc * r.trainer.nodes + rollout_engines(r) * r.rollout.sglang.tp_size
    nodes = gpus // r.trainer.nproc
    return phase_seconds(model_dims(loaded), dtype=r.model.dtype, rollout_dtype=r.rollout.dtype, ranks=gpus,
                         nodes=nodes, offload_optimizer=r.trainer.offload_optimizer,
                         offload_params=r.trainer.offload_params, zero_stage=r.trainer.zero_stage, costs=costs)


def _ratios(result: dict, prefix: str) -> dict:
    rows = {r["schedule"]: r for r in result["rows"]}
    costed = rows["C3PO++, colocated, costed"]
    return {f"{prefix}c3po_colocated_costed_vs_sync_split_per_trained_token": costed["speedup_vs_sync_split"]}


def one_distribution(groups: list[list[int]], label: str, steps: int = STEPS) -> dict:
    cache: dict = {}  # the simulated rollouts, shared by every variant below
    kw = dict(etas=(), steps=steps, splits=(), cache=cache)
    phases = recipe_phases()
    result = async_projection(SYNC_RECIPE, groups, lengths_label=label, colocated_phases=phases, **kw)
    rows = {r["schedule"]: r for r in result["rows"]}
    costed, ideal = rows["C3PO++, colocated, costed"], rows["C3PO++, colocated"]
    out = _ratios(result, "")
    out.update({"c3po_colocated_idealised_vs_sync_split_per_trained_token": ideal["speedup_vs_sync_split"],
                "sync_colocated_costed_vs_sync_split_per_trained_token":
                    rows["sync, colocated, costed"]["speedup_vs_sync_split"],
                "c3po_colocated_costed_step_s": costed["step_s"], "sync_split_step_s": rows["sync, split as shipped"]["step_s"],
                "c3po_colocated_costed_rollout_s": costed["rollout_s"],
                "c3po_colocated_costed_train_s": costed["train_push_s"] - costed["push_trainer_s"],
                "phase_changes_s": sum(phases.values()),
                **{f"phase_{k}_s": v for k, v in phases.items()}})
    for _, key, factors in SENSITIVITY:
        varied = recipe_phases(costs=ASSUMED.scaled(**factors))
        out.update(_ratios(async_projection(SYNC_RECIPE, groups, colocated_phases=varied, **kw), key))
        out[f"{key}phase_changes_s"] = sum(varied.values())
    out["goal_2_27x_vs_sync_split_met"] = out["c3po_colocated_costed_vs_sync_split_per_trained_token"] >= AREAL_GOAL
    out["assumptions"] = {**result["assumptions"], "phase_costs": describe(),
                          "colocated_kv": "the recipe's memory fraction (0.8 x 80 GB) leaves 16 GB outside the pool, "
                                          "more than SGLang's allowance and the offloaded trainer's"}
    return out


def colocated_projection(steps: int = STEPS) -> dict:
    """The keys `make bench` writes under `colocated_projection_7b`, per distribution (lognormal_, areal_)."""
    from rlrecipe.recipe.schema import load_recipe

    recipe = load_recipe(SYNC_RECIPE).recipe
    out: dict = {"steps": steps, "goal": AREAL_GOAL}
    ln = lognormal_groups(*LOGNORMAL, recipe.rl.samples_per_prompt, recipe.rollout.max_new_tokens)
    for prefix, (groups, label) in (("lognormal_", (ln, "assumed log-normal 10000, 0.4, 0.45")),
                                    ("areal_", areal_groups(AREAL_LENGTHS))):
        res = one_distribution(groups, label, steps)
        out[f"{prefix}assumptions"] = res.pop("assumptions")
        out.update({f"{prefix}{k}": v for k, v in res.items()})
    return out


def markdown(result: dict) -> str:
    """The phase table and the sensitivity table of docs/gpu.md ("The colocated layout")."""
    phases = ("release", "reload", "offload", "resume", "push", "verify")
    lines = ["| lengths | rollout s | train s | " + " | ".join(f"{p} s" for p in phases)
             + " | step s | vs sync split | idealised (in-place load only) |", "|" + "---|" * 11]
    for prefix, name in (("lognormal_", "log-normal"), ("areal_", "AReaL logs")):
        g = lambda k, prefix=prefix: result[f"{prefix}{k}"]  # noqa: E731
        lines.append(f"| {name} | {g('c3po_colocated_costed_rollout_s'):.0f} | {g('c3po_colocated_costed_train_s'):.0f} | "
                     + " | ".join(f"{g(f'phase_{p}_s'):.2f}" for p in phases)
                     + f" | {g('c3po_colocated_costed_step_s'):.0f} | "
                       f"{g('c3po_colocated_costed_vs_sync_split_per_trained_token'):.2f}× | "
                       f"{g('c3po_colocated_idealised_vs_sync_split_per_trained_token'):.2f}× |")
    lines += ["", "| assumption varied | phase changes s / step | C3PO++ colocated vs sync split, log-normal | AReaL logs |",
              "|---|---|---|---|",
              f"| as assumed | {result['lognormal_phase_changes_s']:.1f} | "
              f"{result['lognormal_c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× | "
              f"{result['areal_c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× |"]
    for label, key, _ in SENSITIVITY:
        lines.append(f"| {label} | {result[f'lognormal_{key}phase_changes_s']:.1f} | "
                     f"{result[f'lognormal_{key}c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× | "
                     f"{result[f'areal_{key}c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = colocated_projection()
    print(json.dumps(res, indent=2, default=str))
    print(markdown(res))
