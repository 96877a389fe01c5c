"""The colocated projection: the costed row by hand, the recipe's phase changes, the sensitivity's direction."""

import pytest

from bench.projection.asynchronous import schedule_row
from bench.projection.colocated import (
    EXPORT_GATHERED,
    PAGEABLE,
    SENSITIVITY,
    markdown,
    recipe_phases,
    recipe_pushes,
)
from bench.projection.push import PushModel, disk_push
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
    # by handle, as built: the gather and one round of loads at 18.5 GB/s; each of the 29 buckets of 512 MiB
    # posted to the 128 servers 32 at once, 4 rounds, 3 after the first at 10 ms; rank 0's copy into pinned
    # host memory at 55 GB/s (measured on an H100); the gather across nodes at 25 GB/s; the first push's
    # allocation of the pinned memory at 0.95 GB/s over the recipe's 400 steps: about 2.6 s
    assert w / (512 << 20) == pytest.approx(28.37, abs=0.01)
    once = w / 0.95e9 / 400
    ipc = w / 18.5e9 + 3 * 29 * 0.01 + w / 55e9 + w / 25e9 + once
    assert pushes["ipc"] == pytest.approx(ipc) == pytest.approx(2.620, abs=0.001)
    # the step's push: the cheapest built one, by handle here, against the disk's 17.7 s
    assert pushes["disk"] == pytest.approx(17.67, abs=0.01)
    assert phases["push"] == pytest.approx(pushes["ipc"])
    assert recipe_phases(push="disk")["push"] == pytest.approx(pushes["disk"])
    # as before: each bucket posted to the servers one after another (127 after the first); the copy into
    # fresh pageable memory at 1.3 GB/s
    assert recipe_pushes(posted_at_once=1)["ipc"] == pytest.approx(ipc + 124 * 29 * 0.01)
    pageable = recipe_pushes(costs=ASSUMED.scaled(verify_copy_bytes_s=PAGEABLE))["ipc"]
    assert pageable == pytest.approx(ipc - w / 55e9 + w / 1.3e9)
    # the export's gather at the fresh-pageable rate measured, then its write at 2 GB/s: over disk, for the
    # colocated push and, in the same sensitivity row, the shipped split's (trainer side) alike
    gathered = recipe_pushes(costs=ASSUMED.scaled(export_bytes_s=EXPORT_GATHERED))["disk"]
    assert gathered == pytest.approx(pushes["disk"] + w / 1.3e9)
    split = PushModel(export_write_bps=PushModel().export_write_bps / EXPORT_GATHERED)
    assert disk_push(w, 64, model=split)["trainer_s"] == pytest.approx(w / 1.3e9 + w / 2e9)
    assert (phases["release"], phases["resume"], phases["verify"]) == (1.0, 1.0, 0.5)
    # each sensitivity variant of the same push costs more or less in the direction of its change (the
    # export's gather leaves the push by handle as it is)
    for v in SENSITIVITY:
        base = sum(recipe_phases(push=v.push).values())
        varied = sum(recipe_phases(costs=ASSUMED.scaled(**v.factors), push=v.push,
                                   posted_at_once=v.posted_at_once).values())
        if v.key == "export_gather_":
            assert varied == base
        elif v.factors or v.posted_at_once != 32:
            slower = all(f > 1 for f in v.factors.values()) and v.posted_at_once <= 32
            assert (varied > base) == slower, v
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
        for v in SENSITIVITY:
            keys[f"{prefix}{v.key}phase_changes_s"] = 2.0
            keys[f"{prefix}{v.key}c3po_colocated_costed_vs_sync_split_per_trained_token"] = 1.5
    text = markdown(keys)
    # by value twice, over disk twice, by handle five times (as built, and four assumptions varied)
    assert sum(line.startswith("| push ") for line in text.splitlines()) == 9
    assert "| push by handle, as built (not run end to end on a GPU) |" in text
    assert "| as assumed (push disk) |" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 3 + 2 + len(SENSITIVITY)  # each table: its head, then its rows
