"""The colocated projection: the costed row by hand, the recipe's phase changes, the sensitivity's direction."""

import pytest

from bench.projection.asynchronous import schedule_row
from bench.projection.colocated import SENSITIVITY, markdown, recipe_phases, recipe_pushes
from bench.projection.sim import CostModel
from rlrecipe.checks.colocate import ASSUMED
from rlrecipe.checks.model_dims import model_dims
from rlrecipe.recipe.schema import load_recipe
from tests.conftest import REPO


def test_costed_colocated_row_by_hand():
    cost = CostModel(0, 0, 0, 0, 0, train_step_s=5.0, train_token_s=0.1)
    steps = [{"seconds": 30.0, "tokens": 100}]
    phases = {"release": 1.0, "reload": 0.5, "offload": 0.5, "resume": 1.0, "push": 2.0, "verify": 1.0}
    push = {"transport": "in place, phases costed", "trainer_s": sum(phases.values()), "rollout_s": 0.0}
    # 4 GPUs each roll out 100 tokens: 400 trained over 4 GPUs, 0.1 x 100 + 5 = 15 s, + 6 s of phase changes;
    # the step is one after the other: 30 + 21
    row = schedule_row("C3PO++, colocated, costed", steps, gpus=4, rollout_gpus=4, train_gpus=4, eta=0,
                       colocated=True, cost=cost, push=push)
    assert (row["rollout_s"], row["train_push_s"], row["step_s"]) == pytest.approx((30, 21, 51))
    assert row["s_per_1m_trained_tokens"] == pytest.approx(51 / 400 * 1e6)


def test_the_7b_recipe_phase_changes_by_hand():
    loaded = load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml")
    p = model_dims(loaded).params()
    phases = recipe_phases()
    # 128 ZeRO-3 ranks in float16: 2 + 2 + 4 + 12 bytes a parameter over 128, and the 1 GB reduce bucket
    moved = 20 * p / 128 + 2 * 500_000_000
    assert phases["reload"] == phases["offload"] == pytest.approx(moved / 20e9)
    # 128 GPUs on 16 nodes, 128 servers of tp 1. By value (as built): 128 bodies of the weights, one after
    # another, at 0.25 GB/s, and rank 0's gather across nodes at 25 GB/s
    w = 2 * p
    pushes = recipe_pushes()
    assert pushes["tensor"] == pytest.approx(128 * w / 0.25e9 + w / 25e9)
    # over disk: the export (2 GB/s), the 16 nodes' first loads sharing the file system's 100 GB/s, then the
    # other 112 servers from the page cache at 8 GB/s, 32 at a time (4 rounds)
    assert pushes["disk"] == pytest.approx(w / 2e9 + w / (100e9 / 16) + 4 * w / 8e9)
    # in place over CUDA IPC, not built: 18.5 GB/s and the gather
    assert pushes["ipc"] == pytest.approx(w / (29.6e9 / 1.6) + w / 25e9)
    # the step's push: the cheaper built one, over disk here
    assert phases["push"] == pytest.approx(pushes["disk"])
    assert recipe_phases(push="ipc")["push"] == pytest.approx(pushes["ipc"])
    assert (phases["release"], phases["resume"], phases["verify"]) == (1.0, 1.0, 0.5)
    # each sensitivity variant of the same push costs more or less in the direction of its factor
    for _, _, factors, push in SENSITIVITY:
        base = sum(recipe_phases(push=push).values())
        varied = sum(recipe_phases(costs=ASSUMED.scaled(**factors), push=push).values())
        if factors:
            assert (varied > base) == all(f > 1 for f in factors.values()), factors
        else:
            assert varied == base


def test_markdown_has_a_row_per_variant():
    keys = {}
    for prefix in ("lognormal_", "areal_"):
        for k in ("c3po_colocated_costed_rollout_s", "c3po_colocated_costed_train_s", "c3po_colocated_costed_step_s",
                  "c3po_colocated_costed_vs_sync_split_per_trained_token",
                  "c3po_colocated_idealised_vs_sync_split_per_trained_token", "phase_changes_s"):
            keys[prefix + k] = 1.0
        for p in ("release", "reload", "offload", "resume", "push", "verify"):
            keys[f"{prefix}phase_{p}_s"] = 0.5
        keys[f"{prefix}push_kind"] = "disk"
        for _, key, _, _ in SENSITIVITY:
            keys[f"{prefix}{key}phase_changes_s"] = 2.0
            keys[f"{prefix}{key}c3po_colocated_costed_vs_sync_split_per_trained_token"] = 1.5
    text = markdown(keys)
    assert sum(line.startswith("| push ") for line in text.splitlines()) == 5
    assert "| as assumed (push disk) |" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 3 + 2 + len(SENSITIVITY)  # each table: its head, then its rows
