"""The asynchronous schedule's step times (hand-derived) and the four-schedule projection on the
shipped 7B recipe."""

import json

import pytest

from bench.projection.asynchronous import (
    AREAL_LENGTHS,
    areal_groups,
    async_projection,
    pipeline,
    schedule_row,
    steady_step_s,
)
from bench.projection.sim import CostModel


def test_async_step_is_the_larger_side_and_sync_the_sum():
    # rollout 3 s, train + push 2 s: synchronous steps end at 5, 10, 15; with eta = 1 the
    # rollouts of step 1 run while step 0 trains: rollouts end 3, 6, 9, training 5, 8, 11
    assert pipeline([3, 3, 3], [2, 2, 2], eta=0) == [5, 10, 15]
    assert pipeline([3, 3, 3], [2, 2, 2], eta=1) == [5, 8, 11]
    assert steady_step_s([3], [2], eta=0) == pytest.approx(5)
    assert steady_step_s([3], [2], eta=1) == pytest.approx(3)
    assert steady_step_s([2], [3], eta=1) == pytest.approx(3)  # training-bound: the trainer never waits


def test_a_larger_staleness_bound_absorbs_uneven_rollout_steps():
    # rollouts alternate 1 s and 5 s, training 3 s. eta = 1: rollout of step k waits for the
    # weights of step k-2's training; ends of training 4, 9, 12, 17, 20, 25: 8 s per two steps.
    # eta = 2: the short step lets the rollout side run ahead: 4, 9, 12, 15, 18, 21: 3 s a step.
    assert pipeline([1, 5] * 3, [3] * 6, eta=1) == [4, 9, 12, 17, 20, 25]
    assert pipeline([1, 5] * 3, [3] * 6, eta=2) == [4, 9, 12, 15, 18, 21]
    assert [steady_step_s([1, 5], [3, 3], eta) for eta in (0, 1, 2)] == pytest.approx([6, 4, 3])


def test_rollouts_never_start_before_the_weights_eta_versions_back():
    rollout, train = [1, 5, 2, 7, 1, 1], [3, 1, 4, 1, 5, 2]
    for eta in (1, 2, 3):
        ends = pipeline(rollout, train, eta)
        rollout_end, t = [], 0.0
        for k, r in enumerate(rollout):  # rebuild the rollout ends from the training ends
            t = max(rollout_end[-1] if rollout_end else 0.0, ends[k - eta - 1] if k > eta else 0.0) + r
            rollout_end.append(t)
            assert t - r >= (ends[k - eta - 1] if k > eta else 0.0)
            assert ends[k] >= t + train[k]


def test_schedule_row_by_hand():
    cost = CostModel(0, 0, 0, 0, 0, train_step_s=5.0, train_token_s=0.1)
    steps = [{"seconds": 30.0, "tokens": 100}]
    push = {"transport": "disk", "trainer_s": 2.0, "rollout_s": 1.0}
    # 2 engines x 100 tokens = 200 trained; train 0.1 x 200 / 2 GPUs + 5 + the 2 s export = 17 s; the
    # servers' 1 s load before the next rollout: a synchronous step waits for all of it
    sync = schedule_row("sync", steps, gpus=4, rollout_gpus=2, train_gpus=2, eta=0, colocated=False, cost=cost,
                        push=push)
    assert (sync["rollout_s"], sync["train_push_s"], sync["step_s"]) == pytest.approx((31, 17, 48))
    assert sync["s_per_1m_trained_tokens"] == pytest.approx(48 / 200 * 1e6)
    assert sync["rollout_busy"] == pytest.approx(31 / 48) and sync["train_busy"] == pytest.approx(17 / 48)
    # async overlaps the two sides, each with its part of the push: max(31, 17)
    fast = schedule_row("async", steps, gpus=4, rollout_gpus=2, train_gpus=2, eta=1, colocated=False, cost=cost,
                        push=push)
    assert fast["step_s"] == pytest.approx(31) and fast["train_busy"] == pytest.approx(17 / 31)


def test_the_disk_push_reads_the_shared_file_system_once_per_node_by_hand():
    from bench.projection.push import PushModel, broadcast_push, disk_push

    m = PushModel(load_bps=8e9, node_read_bps=12.5e9, fs_read_bps=100e9, export_write_bps=2e9, broadcast_bps=10e9)
    w = 16e9
    # 80 one-GPU servers on 10 nodes: 10 reads of 16 GB; each at min(8, 12.5, 100 / 10) = 8 GB/s = 2 s, then
    # the nodes' other 70 servers from the page cache, 32 at a time as the client loads them (3 rounds of
    # 2 s): 8 s in all; the export written at 2 GB/s
    one = disk_push(w, 80, model=m)
    assert (one["nodes"], one["shared_fs_reads_per_step"], one["shared_fs_bytes_per_step"]) == (10, 10, 160e9)
    assert one["rollout_s"] == pytest.approx(8.0) and one["trainer_s"] == pytest.approx(8.0)
    assert one["shared_fs_bytes_per_node"] == pytest.approx(w)
    # every server reading: 80 reads, 32 at a time (3 rounds), each node's link shared 8 ways (1.5625 GB/s,
    # below the aggregate's 100 / 32): 3 x 16 / 1.5625 s
    every = disk_push(w, 80, per_node=False, model=m)
    assert every["shared_fs_reads_per_step"] == 80 and every["rollout_s"] == pytest.approx(3 * w / 1.5625e9)
    # more nodes: per node, the reads grow with the nodes, not the servers
    assert disk_push(w, 160, model=m)["shared_fs_reads_per_step"] == 20
    assert disk_push(w, 8, model=m)["rollout_s"] == pytest.approx(4.0)  # one node: its link is not the limit
    b = broadcast_push(w, 80, model=m)
    assert b["trainer_s"] == b["rollout_s"] == pytest.approx(1.6) and b["shared_fs_bytes_per_step"] == 0


def test_the_projection_charges_the_push_and_its_override():
    groups = [[200] * 16] * 8
    kw = dict(steps=1, splits=(80,), etas=(2,), overrides=["rl.c3po.token_budget=1638400"], cache={})
    modelled = {r["schedule"]: r for r in async_projection("recipes/7b_boba_icepop_c3po.yaml", groups, **kw)["rows"]}
    forced = {r["schedule"]: r for r in async_projection("recipes/7b_boba_icepop_c3po.yaml", groups, load_s=30.0,
                                                         **kw)["rows"]}
    a = modelled["async + C3PO++, eta=2"]
    assert a["push_transport"] == "disk" and a["shared_fs_reads_per_step"] == 10  # 80 servers, 10 nodes
    assert forced["async + C3PO++, eta=2"]["push_rollout_s"] == 30.0
    assert forced["sync, split as shipped"]["push_rollout_s"] == 30.0
    assert forced["sync, colocated"]["step_s"] == pytest.approx(modelled["sync, colocated"]["step_s"])  # in place
    assert forced["sync, split as shipped"]["step_s"] == pytest.approx(
        modelled["sync, split as shipped"]["step_s"] - modelled["sync, split as shipped"]["push_rollout_s"] + 30.0)


def test_areal_lengths_are_the_logged_ones():
    groups, label = areal_groups()
    data = json.loads(AREAL_LENGTHS.read_text())
    assert [len(g) for g in groups] == [32] * 6 + [2] * 30
    flat = [x for g in groups for x in g]
    assert len(flat) == 252 and max(flat) == 12000 and sum(x == 12000 for x in flat) == 32
    assert "b76b969b9aa0187ae1ef3080a6b45a3a3fdecb74" in data["source"] and "REAL" in label


def test_projection_runs_on_the_shipped_7b_recipe():
    # every response 200 tokens, so every step alike; the budget set to one batch's tokens keeps
    # the C3PO++ steps as small as the synchronous ones
    groups = [[200] * 16] * 8
    out = async_projection("recipes/7b_boba_icepop_c3po.yaml", groups, steps=1, splits=(64, 96), etas=(1,),
                           overrides=["rl.c3po.token_budget=1638400"])
    rows = {r["schedule"]: r for r in out["rows"]}
    assert list(rows) == ["sync, colocated", "sync, split as shipped", "C3PO++, colocated",
                          "C3PO++, split as shipped", "async, eta=1", "async + C3PO++, eta=1"]
    assert all(r["gpus"] == 128 for r in rows.values())
    shipped = rows["sync, split as shipped"]
    assert (shipped["rollout_gpus"], shipped["train_gpus"]) == (64, 64)
    assert shipped["trained_tokens_per_step"] == 512 * 16 * 200
    assert shipped["step_s"] == pytest.approx(shipped["rollout_s"] + shipped["train_push_s"])
    for name in ("async, eta=1", "async + C3PO++, eta=1"):
        r = rows[name]
        assert r["rollout_gpus"] in (64, 96) and r["rollout_gpus"] + r["train_gpus"] == 128
        assert r["step_s"] == pytest.approx(max(r["rollout_s"], r["train_push_s"]))
    assert rows["sync, colocated"]["speedup_vs_sync_colocated"] == 1.0
    assert rows["async, eta=1"]["speedup_vs_sync_split"] > 1.0


def test_cli_reuses_the_rollouts_for_several_training_costs(tmp_path, capsys):
    from bench.projection.asynchronous import main

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[200] * 16] * 8))
    out = main(["recipes/7b_boba_icepop_c3po.yaml", "--lengths", str(lengths), "--steps", "1", "--splits", "64",
                "--eta", "1", "--set", "rl.c3po.token_budget=1638400", "--train-scale", "1,2"])
    one, two = ({r["schedule"]: r for r in t["rows"]}["sync, split as shipped"] for t in out["tables"])
    assert two["rollout_s"] == one["rollout_s"]
    # 512 x 16 x 200 tokens at the default model's seconds per trained token over 64 GPUs, doubled; the 3 s
    # optimizer step and the export (15.2 GB written at 2 GB/s) stay; the cost model's own 2 s push is not added
    from bench.projection.rollout import H100_7B_FITTED

    train = 512 * 16 * 200 * H100_7B_FITTED.train_token_s / 64
    assert one["train_push_s"] == pytest.approx(3 + train + 7.6) and two["train_push_s"] == pytest.approx(3 + 2 * train + 7.6)
    assert "| async, eta=1 | 64 + 64 | 1 |" in capsys.readouterr().out


def test_the_fast_form_gives_every_key_make_bench_writes():
    from bench.projection.async_fast import (
        PUSH_SENSITIVITY_S,
        async_lag,
        async_split,
        markdown,
        one_distribution,
    )

    assert async_split() == 80  # recipes/7b_boba_async.yaml: 80 one-GPU servers
    assert async_lag() == 1  # and its rl.async_lag
    res = one_distribution([[200] * 16] * 8, "flat", async_lag(), steps=1, overrides=["rl.c3po.token_budget=1638400"])
    for key in ["", "every_server_reads_"] + [f"push{s:g}s_" for s in PUSH_SENSITIVITY_S]:
        assert res[f"{key}async_c3po_vs_sync_split_per_trained_token"] > 0
        assert res[f"{key}async_c3po_vs_sync_colocated_per_trained_token"] > 0
    assert res["async_c3po_shared_fs_reads_per_step"] == 10
    # against colocated (which loads in place) a dearer push only costs
    assert res["push60s_async_c3po_vs_sync_colocated_per_trained_token"] <= res["push2s_async_c3po_vs_sync_colocated_per_trained_token"]
    table = markdown({f"{p}{k}": v for p in ("lognormal_", "areal_") for k, v in res.items()})
    assert "| 30 s | AReaL logs |" in table
