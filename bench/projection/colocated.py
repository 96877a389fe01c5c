"""`make bench`'s colocated projection at 7B: C3PO++ on the recipe's 128 GPUs shared by training and
rollout, every phase change costed, beside the shipped split, the idealised colocated row and the
async rows of bench.projection.async_fast.

The phase changes (release, reload, offload, resume, push, verification) come from
rlrecipe/checks/colocate.py, the same assumptions `rlrecipe fit` ranks colocated layouts by; each is
an assumption or a measurement (that module says which, and how to measure it). The push is the
cheapest of the three built (by value over HTTP, weight_sync: tensor; over disk; by CUDA IPC handle,
weight_sync: ipc, verified on CPU against the released SGLang and its handles, copies and host mirror
on one H100 in bench/gpu/ipc_push.py, but not run end to end with SGLang on a GPU), as fit chooses,
the first push's allocation of the pinned host buffers spread over the recipe's rl.steps. The
training itself is the projection's cost model (bench.projection.asynchronous). The sensitivity table
scales one assumption at a time and costs each push kind, the push by handle as it was before
(servers posted one after another; the verification's copy into fresh pageable memory), and the
export's gather at the fresh-pageable rate measured, for the shipped split and the colocated layout
alike.

The goal it is read against: colocated C3PO++ at >= 2.27x the shipped split per trained token (the
figure AReaL v0.3 measured for its asynchronous mode at 7B). Reported, never tuned toward.

    python -m bench.projection.colocated      # prints the keys as JSON, then the tables
"""

from __future__ import annotations

import json
from typing import NamedTuple

from bench.projection.async_fast import AREAL_GOAL, LOGNORMAL, STEPS, SYNC_RECIPE
from bench.projection.asynchronous import AREAL_LENGTHS, areal_groups, async_projection
from bench.projection.push import FRESH_PAGEABLE_BYTES_S, PushModel
from bench.projection.rollout import lognormal_groups
from rlrecipe.checks.colocate import (
    ASSUMED,
    PhaseCosts,
    allowed_pushes,
    cheapest_push,
    describe,
    ipc_push_s,
    phase_seconds,
    push_seconds,
)
from rlrecipe.recipe.systems import MAX_PARALLEL_LOADS

DISK = ("export_bytes_s", "disk_load_bytes_s", "node_read_bytes_s", "fs_read_bytes_s")
# the verification's copy into fresh pageable memory, as before HostMirror (colocate.py's
# verify_copy_bytes_s is the pinned copy as built)
PAGEABLE = ASSUMED.verify_copy_bytes_s / FRESH_PAGEABLE_BYTES_S
# the export's gather to rank 0's CPU at the fresh-pageable rate, then its write at export_bytes_s
EXPORT_GATHERED = 1 + ASSUMED.export_bytes_s / FRESH_PAGEABLE_BYTES_S


class Variant(NamedTuple):
    """One sensitivity row: PhaseCosts.scaled factors (> 1 slower) and the push costed (None: the cheapest
    built one, as fit chooses); `posted_at_once`: how many servers rank 0 posts a bucket by handle to at
    once (MAX_PARALLEL_LOADS as built); `split_export`: the shipped split's export made this much slower
    too (1: the split as assumed)."""

    label: str
    key: str
    factors: dict
    push: str | None
    posted_at_once: int = MAX_PARALLEL_LOADS
    split_export: float = 1.0


SENSITIVITY = (Variant("push by value, as built", "tensor_", {}, "tensor"),
               Variant("push by value 4x faster (1 GB/s)", "tensor0.25x_", {"by_value_bytes_s": 0.25}, "tensor"),
               Variant("push over disk", "disk_", {}, "disk"),
               Variant("push over disk 4x slower", "disk4x_", dict.fromkeys(DISK, 4), "disk"),
               Variant("push by handle, as built (not run end to end on a GPU)", "ipc_", {}, "ipc"),
               Variant("push by handle, the gather and loads 4x slower (4.6 GB/s)", "ipc_gather4x_",
                       {"ipc_push_bytes_s": 4}, "ipc"),
               Variant("push by handle, requests 4x slower (40 ms a round)", "ipc_requests4x_",
                       {"ipc_request_s": 4}, "ipc"),
               Variant("push by handle, each bucket posted to one server after another (as before)",
                       "ipc_one_by_one_", {}, "ipc", 1),
               Variant("push by handle, the verification's copy into fresh pageable memory (1.3 GB/s, as before)",
                       "ipc_pageable_", {"verify_copy_bytes_s": PAGEABLE}, "ipc"),
               Variant("the export's gather at the fresh-pageable rate (1.3 GB/s), split and colocated alike",
                       "export_gather_", {"export_bytes_s": EXPORT_GATHERED}, None, split_export=EXPORT_GATHERED),
               Variant("the same, the colocated push over disk", "export_gather_disk_",
                       {"export_bytes_s": EXPORT_GATHERED}, "disk", split_export=EXPORT_GATHERED),
               Variant("offload 10 GB/s", "offload10_", {"offload_bytes_s": 2}, None),
               Variant("offload 5 GB/s", "offload5_", {"offload_bytes_s": 4}, None),
               Variant("release, resume 5x", "release5x_", {"release_s": 5, "resume_s": 5}, None),
               Variant("verify 10x", "verify10x_", {"verify_s": 10}, None),
               Variant("all 4x", "all4x_", {**dict.fromkeys(DISK, 4), "by_value_bytes_s": 4, "ipc_push_bytes_s": 4,
                                            "ipc_request_s": 4, "verify_copy_bytes_s": 4, "mirror_alloc_bytes_s": 4,
                                            "offload_bytes_s": 4, "release_s": 4, "resume_s": 4, "verify_s": 4},
                       None))


def recipe_pushes(recipe_path: str = SYNC_RECIPE, costs: PhaseCosts = ASSUMED,
                  posted_at_once: int = MAX_PARALLEL_LOADS) -> dict[str, float]:
    """Seconds of one push by each way (push_seconds) into the recipe's servers, colocated on all its GPUs
    (trainer ranks + servers'): as many servers of its tensor parallelism as cover them; by handle with
    each bucket posted to `posted_at_once` servers at once (MAX_PARALLEL_LOADS as built), the first
    push's pinned allocation spread over the recipe's rl.steps."""
    from rlrecipe.checks.model_dims import model_dims
    from rlrecipe.checks.plan import rollout_engines
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe_path)
    r = loaded.recipe
    tp = r.rollout.sglang.tp_size
    gpus = r.trainer.nproc * r.trainer.nodes + rollout_engines(r) * tp
    d, shape = model_dims(loaded), dict(servers=gpus // tp, nodes=gpus // r.trainer.nproc,
                                        bucket_bytes=r.rollout.sglang.weight_sync_bucket_mb << 20, costs=costs,
                                        pushes_per_run=r.rl.steps)
    out = push_seconds(d, r.rollout.dtype, tp=tp, **shape)
    if posted_at_once != MAX_PARALLEL_LOADS:
        out["ipc"] = ipc_push_s(d, r.rollout.dtype, posted_at_once=posted_at_once, **shape)
    return out


def recipe_phases(recipe_path: str = SYNC_RECIPE, costs: PhaseCosts = ASSUMED,
                  push: str | None = None, posted_at_once: int = MAX_PARALLEL_LOADS) -> dict[str, float]:
    """The phase changes of the recipe's colocated step, on all its GPUs (trainer ranks + servers'), with
    the push `push` ("tensor", "disk", "ipc") or, None, the cheapest built one (colocated, all three are
    allowed)."""
    from rlrecipe.checks.model_dims import model_dims
    from rlrecipe.checks.plan import rollout_engines
    from rlrecipe.recipe.schema import load_recipe

    loaded = load_recipe(recipe_path)
    r = loaded.recipe
    gpus = r.trainer.nproc * r.trainer.nodes + rollout_engines(r) * r.rollout.sglang.tp_size
    pushes = recipe_pushes(recipe_path, costs, posted_at_once)
    kind = push or cheapest_push(pushes, allowed_pushes(colocated=True))
    return phase_seconds(model_dims(loaded), dtype=r.model.dtype, ranks=gpus,
                         offload_optimizer=r.trainer.offload_optimizer, offload_params=r.trainer.offload_params,
                         push_s=pushes[kind], zero_stage=r.trainer.zero_stage, costs=costs)


def _ratios(result: dict, prefix: str) -> dict:
    rows = {r["schedule"]: r for r in result["rows"]}
    costed = rows["C3PO++, colocated, costed"]
    return {f"{prefix}c3po_colocated_costed_vs_sync_split_per_trained_token": costed["speedup_vs_sync_split"]}


def one_distribution(groups: list[list[int]], label: str, steps: int = STEPS) -> dict:
    # the simulated rollouts are shared by every variant below, and with async_fast's when it ran first
    # in this process (async_projection's simulation_cache)
    kw = dict(etas=(), steps=steps, splits=())
    phases, pushes = recipe_phases(), recipe_pushes()
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
                "push_kind": cheapest_push(pushes, allowed_pushes(colocated=True)),
                **{f"push_{k}_s": v for k, v in pushes.items()},
                **{f"phase_{k}_s": v for k, v in phases.items()}})
    for v in SENSITIVITY:
        varied = recipe_phases(costs=ASSUMED.scaled(**v.factors), push=v.push, posted_at_once=v.posted_at_once)
        split = PushModel(export_write_bps=PushModel().export_write_bps / v.split_export)
        out.update(_ratios(async_projection(SYNC_RECIPE, groups, colocated_phases=varied, push_model=split, **kw),
                           v.key))
        out[f"{v.key}phase_changes_s"] = sum(varied.values())
        out[f"{v.key}push_s"] = varied["push"]
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
              f"| as assumed (push {result['lognormal_push_kind']}) | {result['lognormal_phase_changes_s']:.1f} | "
              f"{result['lognormal_c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× | "
              f"{result['areal_c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× |"]
    for v in SENSITIVITY:
        label, key = v.label, v.key
        lines.append(f"| {label} | {result[f'lognormal_{key}phase_changes_s']:.1f} | "
                     f"{result[f'lognormal_{key}c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× | "
                     f"{result[f'areal_{key}c3po_colocated_costed_vs_sync_split_per_trained_token']:.3f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = colocated_projection()
    print(json.dumps(res, indent=2, default=str))
    print(markdown(res))
