"""`make bench`'s fast form of the 7B asynchronous projection (bench.projection.asynchronous), push costed.

The shipped synchronous recipe (recipes/7b_boba_icepop_c3po.yaml, 64 + 64 GPUs) against
recipes/7b_boba_async.yaml's layout (async + C3PO++ at its rl.async_lag, 80 rollout + 48 training GPUs), on the two
length distributions (the assumed log-normal one and AReaL's logged one), with `STEPS` simulated steps per
engine share instead of 5 or 10 (ratios move by a few percent: docs/async_projection.md) and only the
async recipe's split, so it takes a minute or two. Per trained token, against the shipped split and the
idealised colocated layout, with the push modelled (bench.projection.push: disk, one shared-file-system
read per node) and with the rollout side's pause per push forced to 2, 10, 30 and 60 s (the sensitivity);
and the same with every server reading the shared file system (the push before it went node by node).

The goal it is read against: AReaL v0.3 measured 2.27x at 7B against its own synchronous mode. Reported,
never tuned toward.

    python -m bench.projection.async_fast [--eta 2]   # prints the keys as JSON (--eta: another lag than the recipe's)
"""

from __future__ import annotations

import json

from bench.projection.asynchronous import AREAL_LENGTHS, areal_groups, async_projection
from bench.projection.rollout import lognormal_groups

SYNC_RECIPE = "recipes/7b_boba_icepop_c3po.yaml"
ASYNC_RECIPE = "recipes/7b_boba_async.yaml"
STEPS = 2
PUSH_SENSITIVITY_S = (2.0, 10.0, 30.0, 60.0)
AREAL_GOAL = 2.27  # AReaL v0.3, 7B, async vs its synchronous mode, per trained token
LOGNORMAL = (10000.0, 0.4, 0.45)


def async_lag() -> int:
    """The async recipe's rl.async_lag: the staleness the projection takes for it."""
    from rlrecipe.recipe.schema import load_recipe

    return load_recipe(ASYNC_RECIPE).recipe.rl.async_lag


def async_split() -> int:
    """The async recipe's rollout GPUs (its servers x tp)."""
    from rlrecipe.checks.plan import rollout_engines
    from rlrecipe.recipe.schema import load_recipe

    recipe = load_recipe(ASYNC_RECIPE).recipe
    return rollout_engines(recipe) * recipe.rollout.sglang.tp_size


def _ratios(result: dict, prefix: str, eta: int) -> dict:
    rows = {r["schedule"]: r for r in result["rows"]}
    a = rows[f"async + C3PO++, eta={eta}"]
    out = {f"{prefix}async_c3po_vs_sync_split_per_trained_token": a["speedup_vs_sync_split"],
           f"{prefix}async_c3po_vs_sync_colocated_per_trained_token": a["speedup_vs_sync_colocated"]}
    if not prefix:
        c = rows["C3PO++, colocated"]
        out.update({"async_c3po_vs_c3po_split_per_trained_token": (rows["C3PO++, split as shipped"]["s_per_1m_trained_tokens"]
                                                                / a["s_per_1m_trained_tokens"]),
                    "c3po_colocated_vs_sync_split_per_trained_token": c["speedup_vs_sync_split"],
                    "async_vs_sync_split_per_trained_token": rows[f"async, eta={eta}"]["speedup_vs_sync_split"],
                    "sync_colocated_vs_sync_split_per_trained_token": rows["sync, colocated"]["speedup_vs_sync_split"],
                    "async_c3po_step_s": a["step_s"], "sync_split_step_s": rows["sync, split as shipped"]["step_s"],
                    "async_c3po_push_rollout_s": a["push_rollout_s"], "async_c3po_push_trainer_s": a["push_trainer_s"],
                    "async_c3po_shared_fs_reads_per_step": a["shared_fs_reads_per_step"],
                    "sync_split_push_rollout_s": rows["sync, split as shipped"]["push_rollout_s"]})
    return out


def one_distribution(groups: list[list[int]], label: str, eta: int, steps: int = STEPS,
                     overrides: list[str] | None = None) -> dict:
    # the simulated rollouts are shared by every push variant below (and colocated's, on the same lengths):
    # async_projection keeps them for the process (simulation_cache)
    kw = dict(etas=(eta,), steps=steps, splits=(async_split(),), overrides=overrides)
    modelled = async_projection(SYNC_RECIPE, groups, lengths_label=label, **kw)
    out = _ratios(modelled, "", eta)
    out.update(_ratios(async_projection(SYNC_RECIPE, groups, per_node=False, **kw), "every_server_reads_", eta))
    for push_s in PUSH_SENSITIVITY_S:
        out.update(_ratios(async_projection(SYNC_RECIPE, groups, load_s=push_s, **kw), f"push{push_s:g}s_", eta))
    out["goal_2_27x_vs_sync_split_met"] = out["async_c3po_vs_sync_split_per_trained_token"] >= AREAL_GOAL
    out["assumptions"] = modelled["assumptions"]
    return out


def fast_projection(steps: int = STEPS, eta: int | None = None) -> dict:
    """The keys `make bench` writes under `async_projection_7b`: per distribution (lognormal_, areal_), at
    the async recipe's lag unless `eta` says another."""
    from rlrecipe.recipe.schema import load_recipe

    recipe = load_recipe(SYNC_RECIPE).recipe
    eta = async_lag() if eta is None else eta
    out: dict = {"steps": steps, "eta": eta, "areal_goal": AREAL_GOAL, "async_rollout_gpus": async_split()}
    ln = lognormal_groups(*LOGNORMAL, recipe.rl.samples_per_prompt, recipe.rollout.max_new_tokens)
    for prefix, (groups, label) in (("lognormal_", (ln, "assumed log-normal 10000, 0.4, 0.45")),
                                    ("areal_", areal_groups(AREAL_LENGTHS))):
        res = one_distribution(groups, label, eta, steps)
        out[f"{prefix}assumptions"] = res.pop("assumptions")
        out.update({f"{prefix}{k}": v for k, v in res.items()})
    return out


def markdown(result: dict) -> str:
    """The sensitivity table of docs/async_projection.md."""
    lines = ["| rollout-side pause per push | lengths | async + C3PO++ vs sync split | vs sync colocated |",
             "|---|---|---|---|"]
    for prefix, name in (("lognormal_", "log-normal"), ("areal_", "AReaL logs")):
        variants = [("modelled, one read per node", ""), ("modelled, every server reads", "every_server_reads_")]
        variants += [(f"{s:g} s", f"push{s:g}s_") for s in PUSH_SENSITIVITY_S]
        for label, key in variants:
            lines.append(f"| {label} | {name} | "
                         f"{result[f'{prefix}{key}async_c3po_vs_sync_split_per_trained_token']:.2f}× | "
                         f"{result[f'{prefix}{key}async_c3po_vs_sync_colocated_per_trained_token']:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eta", type=int, help="the staleness to project async at (default: the async recipe's lag)")
    res = fast_projection(eta=ap.parse_args().eta)
    print(json.dumps(res, indent=2, default=str))
    print(markdown(res))
