"""The colocated layout: its phase costs and per-phase memory by hand, and fit choosing it where it is faster."""

from __future__ import annotations

import math

import pytest

from rlrecipe.checks.colocate import (
    ASSUMED,
    PhaseCosts,
    allowed_pushes,
    cheapest_push,
    colocated_training,
    ipc_push_s,
    phase_seconds,
    push_seconds,
)
from rlrecipe.checks.fit import fit
from rlrecipe.checks.fit_layout import Machine
from rlrecipe.checks.fit_search import Search
from rlrecipe.checks.host_disk import footprint
from rlrecipe.checks.memory import (
    DS_REDUCE_BUCKET,
    SGLANG_OUTSIDE_POOL_GIB,
    TRAINER_OFFLOADED_GIB,
    offloaded_bytes,
)
from rlrecipe.checks.model_dims import GIB, ModelDims, model_dims
from rlrecipe.checks.plan import plan
from rlrecipe.checks.step_time import STEP_OVERHEAD_S, Training
from rlrecipe.recipe.schema import load_recipe
from tests.conftest import REPO

DIMS = ModelDims(vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=True)
RECIPE_1_5B = "recipes/1.5b_boba_icepop_c3po_1x80gb.yaml"
# the 1.5B recipe's batch, as its header's fit command sets it
ONE_GPU_BATCH = ["rl.prompts_per_step=128", "rl.samples_per_prompt=8", "rollout.max_new_tokens=8192",
                 "rl.c3po.token_budget=4000000", "rl.c3po.pool_capacity=2048"]


def test_phase_seconds_by_hand():
    p = DIMS.params()
    # ZeRO-3 over 4 ranks, bf16: parameters, gradients (2 + 2 bytes), fp32 gradients (4), optimizer (12), a
    # quarter each, and the 2-byte reduce bucket
    moved = (2 + 2 + 4 + 12) * p / 4 + 2 * DS_REDUCE_BUCKET
    assert offloaded_bytes(DIMS, "bfloat16", 4, False, False) == pytest.approx(moved)
    # ZeRO-Offload keeps the optimizer, the fp32 gradients and (from ZeRO-2) the 16-bit gradient partition on
    # the host already (ZeRO-3's grad_partitions_flat_buffer is on the optimizer's device); offloaded
    # parameters live there too: only the reduce bucket moves
    assert offloaded_bytes(DIMS, "bfloat16", 4, True, True) == pytest.approx(2 * DS_REDUCE_BUCKET)
    # with the parameters kept on the GPU, their quarter moves as well
    assert offloaded_bytes(DIMS, "bfloat16", 4, True, False) == pytest.approx(2 * p / 4 + 2 * DS_REDUCE_BUCKET)
    # ZeRO-2 offloaded: the whole 16-bit parameters alone (its gradients are reduced into host memory)
    assert offloaded_bytes(DIMS, "bfloat16", 4, True, False, 2) == pytest.approx(2 * p)
    # ZeRO-1 offloaded keeps its whole 16-bit gradients on the GPU until the boundary: they move
    assert offloaded_bytes(DIMS, "bfloat16", 4, True, False, 1) == pytest.approx(2 * p + 2 * p)
    # ZeRO-2: whole 16-bit parameters, no bucket kept
    assert offloaded_bytes(DIMS, "bfloat16", 4, False, False, 2) == pytest.approx(2 * p + (2 + 4 + 12) * p / 4)
    one = phase_seconds(DIMS, dtype="bfloat16", ranks=4, offload_optimizer=False, offload_params=False, push_s=7.0)
    assert one == pytest.approx({"release": 1.0, "reload": moved / 20e9, "offload": moved / 20e9, "resume": 1.0,
                                 "push": 7.0, "verify": 0.5})
    # a slower bandwidth is divided, a time multiplied
    two = phase_seconds(DIMS, dtype="bfloat16", ranks=4, offload_optimizer=False, offload_params=False, push_s=0.0,
                        costs=ASSUMED.scaled(offload_bytes_s=2, release_s=3))
    assert two["reload"] == pytest.approx(moved / 10e9) and two["release"] == 3.0


def test_push_seconds_by_hand():
    w = 2 * DIMS.params()  # bf16 weights
    # by value, as built: 4 servers of tp 2, each body carrying the weights once per rank, one server after
    # another, at 0.25 GB/s
    one_node = push_seconds(DIMS, "bfloat16", servers=4, tp=2)
    assert one_node["tensor"] == pytest.approx(4 * 2 * w / 0.25e9)
    # over disk: the export at 2 GB/s, then the first server from the shared file system (8 GB/s), then the
    # other 3 at once from the page cache (8 GB/s)
    assert one_node["disk"] == pytest.approx(w / 2e9 + w / 8e9 + w / 8e9)
    # by handle: the gather, the shared buckets and one round of loads at 18.5 GB/s (the 4 servers posted
    # side by side, up to 32 at once: no further round); rank 0's copy of the weights into pinned host
    # memory at the 55 GB/s measured
    assert one_node["ipc"] == pytest.approx(w / 18.5e9 + w / 55e9)
    # over a run of 400 pushes, the first push's allocation of that memory (0.95 GB/s) spread over them
    run = push_seconds(DIMS, "bfloat16", servers=4, tp=2, pushes_per_run=400)
    assert run["ipc"] == pytest.approx(w / 18.5e9 + w / 55e9 + w / 0.95e9 / 400)
    assert {k: run[k] for k in ("tensor", "disk")} == {k: one_node[k] for k in ("tensor", "disk")}
    # one server: a single load
    assert push_seconds(DIMS, "bfloat16", servers=1, tp=1)["disk"] == pytest.approx(w / 2e9 + w / 8e9)
    # 128 servers on 16 nodes: rank 0's gather crosses the network (25 GB/s) for the pushes by tensors; over
    # disk the 16 first loads share the file system's 100 GB/s (6.25 GB/s each), then the other 112 load
    # 32 at a time (4 rounds)
    wide = push_seconds(DIMS, "bfloat16", servers=128, tp=1, nodes=16)
    assert wide["tensor"] == pytest.approx(128 * w / 0.25e9 + w / 25e9)
    assert wide["disk"] == pytest.approx(w / 2e9 + w / 6.25e9 + 4 * w / 8e9)
    # by handle: 4 rounds of 32 servers, 3 after the first, one bucket each at 10 ms; each rank's gather
    # across nodes at 25 GB/s
    assert wide["ipc"] == pytest.approx(w / 18.5e9 + 3 * 1 * 0.01 + w / 55e9 + w / 25e9)
    # a scaled bandwidth is divided
    slow = push_seconds(DIMS, "bfloat16", servers=4, tp=2, costs=ASSUMED.scaled(by_value_bytes_s=2))
    assert slow["tensor"] == pytest.approx(2 * one_node["tensor"])


def test_disk_push_is_bench_projection_pushs_disk_push():
    from bench.projection.push import PushModel, disk_push

    # the same constants as the split layouts' projection, and the same order of loads
    model = PushModel()
    assert (ASSUMED.export_bytes_s, ASSUMED.disk_load_bytes_s, ASSUMED.node_read_bytes_s,
            ASSUMED.fs_read_bytes_s) == (model.export_write_bps, model.load_bps, model.node_read_bps,
                                         model.fs_read_bps)
    w = 2 * DIMS.params()
    for servers, nodes, tp in ((8, 1, 1), (2, 1, 4), (128, 16, 1), (1, 1, 1)):
        split = disk_push(w, servers, gpus_per_server=tp)
        ours = push_seconds(DIMS, "bfloat16", servers=servers, tp=tp, nodes=nodes)["disk"]
        assert ours == pytest.approx(split["trainer_s"] + split["rollout_s"]), (servers, nodes)


def test_push_by_handle_by_hand():
    w = 2 * DIMS.params()
    # buckets of a third of the weights (rounded up): 3 requests a server; 5 servers, posted side by side
    # (up to 32 at once, as built): one round, in the 18.5 GB/s figure
    third = math.ceil(w / 3)
    seconds = ipc_push_s(DIMS, "bfloat16", servers=5, bucket_bytes=third)
    assert seconds == pytest.approx(w / 18.5e9 + w / 55e9)
    # posted to 2 servers at once: 3 rounds, 2 after the first, 3 buckets each; one after another: 4 after
    assert ipc_push_s(DIMS, "bfloat16", servers=5, bucket_bytes=third, posted_at_once=2) == pytest.approx(
        w / 18.5e9 + 2 * 3 * 0.01 + w / 55e9)
    assert ipc_push_s(DIMS, "bfloat16", servers=5, bucket_bytes=third, posted_at_once=1) == pytest.approx(
        w / 18.5e9 + 4 * 3 * 0.01 + w / 55e9)
    # 33 servers: a second round of one
    assert ipc_push_s(DIMS, "bfloat16", servers=33, bucket_bytes=third) == pytest.approx(
        w / 18.5e9 + 1 * 3 * 0.01 + w / 55e9)
    # the request is a time (multiplied), the copy and the allocation bandwidths (divided)
    slow = ipc_push_s(DIMS, "bfloat16", servers=5, bucket_bytes=third, posted_at_once=2, pushes_per_run=10,
                      costs=ASSUMED.scaled(ipc_request_s=2, verify_copy_bytes_s=2, mirror_alloc_bytes_s=2))
    assert slow == pytest.approx(w / 18.5e9 + 2 * 2 * 3 * 0.01 + 2 * w / 55e9 + 2 * w / 0.95e9 / 10)
    # 7B (7,615,616,512 parameters, 15.23 GB in bf16) into one server: the gather and loads 0.82 s, rank 0's
    # copy into pinned host memory 0.28 s (the 0.278 s it added to the push on an H100), and, over the
    # recipe's 400 steps, the first push's allocation of that memory (16.0 s; 15.99 s measured) 0.04 s a push
    d7b = model_dims(load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml"))
    w7 = 2 * 7_615_616_512
    assert 2 * d7b.params() == w7
    assert ipc_push_s(d7b, "bfloat16", servers=1) == pytest.approx(w7 / 18.5e9 + w7 / 55e9)
    assert (w7 / 18.5e9, w7 / 55e9, w7 / 0.95e9) == pytest.approx((0.8233, 0.2769, 16.033), abs=1e-3)
    assert ipc_push_s(d7b, "bfloat16", servers=1, pushes_per_run=400) == pytest.approx(1.1403, abs=1e-4)
    # on its 8 GPUs of one node, 8 servers: one round of 29 buckets of 512 MiB each (15.23 GB / 0.537 GB, up)
    assert math.ceil(w7 / (512 << 20)) == 29
    assert push_seconds(d7b, "bfloat16", servers=8, tp=1, pushes_per_run=400)["ipc"] == pytest.approx(
        w7 / 18.5e9 + w7 / 55e9 + w7 / 0.95e9 / 400)


def test_the_cheapest_allowed_push_is_chosen():
    seconds = {"tensor": 2.0, "disk": 3.0, "ipc": 0.1}
    assert cheapest_push(seconds) == "ipc"
    assert cheapest_push({"tensor": 4.0, "disk": 3.0, "ipc": 5.0}) == "disk"
    assert cheapest_push({"tensor": 2.0, "disk": 2.0, "ipc": 2.0}) == "tensor"  # a tie: nothing on disk
    # a handle opens only on its own machine: colocated (any nodes) or one node allow it, a split across
    # nodes does not
    assert allowed_pushes(colocated=True, trainer_nodes=16, rollout_nodes=16) == ("tensor", "disk", "ipc")
    assert allowed_pushes(colocated=False) == ("tensor", "disk", "ipc")
    for nodes in ((2, 2), (1, 2), (2, 1)):
        split = allowed_pushes(colocated=False, trainer_nodes=nodes[0], rollout_nodes=nodes[1])
        assert split == ("tensor", "disk")
        assert cheapest_push(seconds, split) == "tensor"
    # one node split: each server rank reads one trainer rank's handles, so no more server GPUs than ranks
    assert "ipc" in allowed_pushes(colocated=False, server_gpus=4, trainer_ranks=4)
    assert "ipc" not in allowed_pushes(colocated=False, server_gpus=6, trainer_ranks=2)


def test_colocated_training_swaps_the_split_push_for_the_phase_changes():
    split = Training(110.0, 3, {"compute": 100.0, "step and push": 10.0})
    phases = {"release": 1.0, "reload": 2.0, "offload": 2.0, "resume": 1.0, "push": 0.5, "verify": 0.5}
    shared = colocated_training(split, phases)
    assert shared.parts == {"compute": 100.0, "step": STEP_OVERHEAD_S, **phases}
    assert shared.seconds == pytest.approx(100.0 + STEP_OVERHEAD_S + 7.0) and shared.microbatches == 3


def test_colocated_plan_by_hand():
    loaded = load_recipe(REPO / RECIPE_1_5B)
    r = loaded.recipe
    d, _, budgets = plan(loaded)
    train, rollout, phase = budgets
    assert (train.side, rollout.side, phase.side) == ("train", "rollout", "rollout phase")
    # training phase: the trainer's budget and what the released servers keep
    assert train.parts["SGLang while released"] == SGLANG_OUTSIDE_POOL_GIB * GIB
    # rollout phase: SGLang's pool (a fraction of the GPU), its outside allowance, the offloaded trainer
    gpu = r.trainer.gpu_memory_gib * GIB
    assert phase.capacity == gpu
    assert phase.total == pytest.approx(r.rollout.sglang.mem_fraction_static * gpu
                                        + (SGLANG_OUTSIDE_POOL_GIB + TRAINER_OFFLOADED_GIB) * GIB)
    assert all(b.fits for b in budgets)
    # the host holds every local rank's offloaded state, pinned
    host = footprint(r, d).host["trainer state offloaded (pinned)"]
    assert host == pytest.approx(r.trainer.nproc * offloaded_bytes(d, r.model.dtype, 1, False, False))
    # pushed by handle, rank 0 also keeps its copy of the weights (pinned) from push to push; over disk not
    mirror = "push by handle's copy (kept, pinned)"
    assert r.rollout.sglang.weight_sync == "ipc"
    assert footprint(r, d).host[mirror] == pytest.approx(2 * d.params())  # float16
    disk = load_recipe(REPO / RECIPE_1_5B, ["rollout.sglang.weight_sync=disk"]).recipe
    assert mirror not in footprint(disk, d).host
    # fit counts it where it chooses that push: its layout's host figure is the plan's
    best = fit(load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml",
                           ["model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "model.revision=null",
                            *ONE_GPU_BATCH]), Machine(1, 1, 80)).layouts[0]
    assert best.push == "ipc" and best.train.host == pytest.approx(sum(footprint(r, d).host.values()))
    # more memory fraction than the GPU has beside the allowances: the rollout phase does not fit
    over = load_recipe(REPO / RECIPE_1_5B, ["rollout.sglang.mem_fraction_static=0.95"])
    assert not plan(over)[2][2].fits


def test_the_shipped_1_5b_recipe_is_fits_layout_on_one_gpu(tmp_path):
    loaded = load_recipe(REPO / RECIPE_1_5B)
    source = load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml",
                         ["model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "model.revision=null",
                          *ONE_GPU_BATCH])
    # the 7B recipe's algorithm at one GPU's batch, the 1.5B model
    assert loaded.recipe.rl == source.recipe.rl and loaded.recipe.algorithm_sha256() == source.recipe.algorithm_sha256()
    best = fit(source, Machine(1, 1, 80)).layouts[0]
    r, s, t = loaded.recipe, loaded.recipe.rollout.sglang, loaded.recipe.trainer
    assert best.colocated and r.rollout.colocate and r.rollout.engine == "sglang" and t.engine == "deepspeed"
    assert s.num_servers * s.tp_size * s.dp_size == t.nproc * t.nodes == 1
    assert (t.zero_stage, t.offload_optimizer, t.offload_params) == (best.train.zero_stage,
                                                                      best.train.offload_optimizer,
                                                                      best.train.offload_params)
    assert (s.tp_size, s.mem_fraction_static) == (best.rollout.tp, best.rollout.mem_fraction)
    header = " ".join(ln.lstrip("#").strip() for ln in (REPO / RECIPE_1_5B).read_text().splitlines()
                      if ln.startswith("#"))
    assert f"Projected {best.step_s:.0f} s a step" in header and f"{best.hours:.0f} h for its 400 steps" in header
    # on 12 GB the refusal's figure is the header's. By hand, ZeRO-3 with the optimizer and parameters
    # offloaded (the optimizer step on the host, nothing of it on the GPU), 256-token chunks: what ZeRO-3
    # keeps live of the weights (DeepSpeed's default 1e9 parameters, 16-bit, and the persistent ones) 1.96
    # GiB, activations 0.74, the head's backward 1.21 beyond them, the reduce bucket 0.93, the released
    # SGLang's 6, the reserve 1 GiB + 5% of 12: 12.4, over 11.4 usable
    refusal = fit(source, Machine(1, 1, 12)).refusal
    least = min(Search(source, Machine(1, 1, 12)).train_options(1, 1, colocated=True), key=lambda o: o.peak)
    assert least.peak / GIB == pytest.approx(1.96 + 0.74 + 1.21 + 0.93 + 6 + 1.6, abs=0.02)
    assert f"training phase needs {least.peak / GIB:.1f} GiB per GPU > 11.4 usable" in refusal
    assert refusal.endswith("Smallest that fits: 1 x 16 GB.")
    assert f"needs {least.peak / GIB:.1f} GiB per GPU at its least" in header and "On 1 x 12 GB no layout" in header
    on_16 = fit(source, Machine(1, 1, 16)).layouts[0]
    assert on_16.train.offload_params and f"{on_16.step_s:.0f} s a step projected" in header
    assert fit(source, Machine(1, 1, 24)).layouts


def test_a_colocated_step_is_its_rollout_and_its_training_with_the_phase_changes():
    loaded = load_recipe(REPO / "recipes/7b_boba.yaml")
    best = fit(loaded, Machine(8, 1, 80)).layouts[0]
    assert best.colocated and best.train.zero_stage == 3
    parts = best.train.time.parts
    assert set(parts) >= {"release", "reload", "offload", "resume", "push", "verify", "step"}
    assert "step and push" not in parts
    assert best.step_s == pytest.approx(best.rollout.time.seconds + sum(parts.values()))
    # every GPU rolls out: 8 servers of tp 1, each with the KV cache of a 0.9 x 80 GB pool
    assert best.rollout.gpus == best.train.ranks == 8
    # the push by handle into 8 servers side by side: the gather and loads, rank 0's pinned copy and the
    # first push's allocation over the 400 steps
    w = 2 * model_dims(loaded).params()
    assert best.push == "ipc" and parts["push"] == pytest.approx(w / 18.5e9 + w / 55e9 + w / 0.95e9 / 400)
    # over disk: the export, then one load and seven side by side; by value 8 x the weights at 0.25 GB/s
    pushes = Search(loaded, Machine(8, 1, 80)).pushes(best.rollout)
    assert pushes["disk"] == pytest.approx(w / 2e9 + 2 * w / 8e9)
    assert pushes["tensor"] == pytest.approx(8 * w / 0.25e9)


# by value at 5 GB/s: one server's body (1 x tp 1) costs less than the disk's export alone (2 GB/s);
# eight GPUs' bodies cost more than the export and two rounds of loads. The push by handle with the
# verification's copy into fresh pageable memory, as it was before (1.3 GB/s measured on an H100), costs
# more than both
PAGEABLE_COPY = dict(verify_copy_bytes_s=1.3e9)
FAST_BY_VALUE = PhaseCosts(by_value_bytes_s=5e9, **PAGEABLE_COPY)


def test_fit_pushes_by_value_where_that_is_cheaper_and_over_disk_where_that_is(tmp_path):
    source = load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml",
                         ["model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "model.revision=null",
                          *ONE_GPU_BATCH])
    w = 2 * model_dims(source).params()
    # one server on one GPU, by value at 5 GB/s: w / 5e9 against the disk's w / 2e9 + w / 8e9
    fast = Search(source, Machine(1, 1, 80), costs=FAST_BY_VALUE).layouts()[0]
    assert fast.colocated and fast.push == "tensor"
    assert fast.train.time.parts["push"] == pytest.approx(w / 5e9)
    # 8 GPUs, 8 servers or fewer of more ranks: by value 8 x w / 5e9 (whatever the tp) against at most
    # w / 2e9 + 2 x w / 8e9 over disk
    eight = Search(source, Machine(8, 1, 80), costs=FAST_BY_VALUE).colocated_layouts()[0]
    assert eight.push == "disk"
    assert eight.train.time.parts["push"] == pytest.approx(w / 2e9 + (2 if eight.rollout.servers > 1 else 1) * w / 8e9)
    # the fitted recipe carries the choice, and says why
    from rlrecipe.checks.fit_layout import Fit
    from rlrecipe.checks.fit_recipe import fitted_recipe

    text, recipe = fitted_recipe(Fit(source, Machine(1, 1, 80), [fast]), fast, tmp_path / "one.yaml")
    assert recipe.rollout.colocate and recipe.rollout.sglang.weight_sync == "tensor"
    assert "rollout.sglang.weight_sync disk -> tensor" in " ".join(ln.lstrip("#").strip() for ln in text.splitlines()
                                                                   if ln.startswith("#"))
    # with the pageable copy, one GPU's single server is cheaper over disk too
    assert Search(source, Machine(1, 1, 80), costs=PhaseCosts(**PAGEABLE_COPY)).layouts()[0].push == "disk"


def test_fit_pushes_by_handle_where_that_is_cheaper(tmp_path):
    source = load_recipe(REPO / "recipes/7b_boba_icepop_c3po.yaml",
                         ["model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "model.revision=null",
                          *ONE_GPU_BATCH])
    w = 2 * model_dims(source).params()
    # one server on one GPU, as built: w / 18.5e9 + w / 55e9 and the first push's allocation over the 400
    # steps (0.27 s), against the disk's w / 2e9 + w / 8e9 (2.2 s) and by value w / 0.25e9 (14.2 s)
    one = Search(source, Machine(1, 1, 80)).layouts()[0]
    assert one.colocated and one.push == "ipc"
    assert one.train.time.parts["push"] == pytest.approx(w / 18.5e9 + w / 55e9 + w / 0.95e9 / 400)
    assert one.train.time.parts["push"] == pytest.approx(0.2661, abs=1e-4)
    # the shipped 1.5B recipe is fit's layout, so it pushes by handle
    assert load_recipe(REPO / RECIPE_1_5B).recipe.rollout.sglang.weight_sync == fit(
        source, Machine(1, 1, 80)).layouts[0].push == "ipc"
    # 8 GPUs: the servers posted side by side, one round whatever their number up to 32
    eight = Search(source, Machine(8, 1, 80)).colocated_layouts()[0]
    assert eight.push == "ipc" and eight.rollout.servers <= 32
    assert eight.train.time.parts["push"] == pytest.approx(w / 18.5e9 + w / 55e9 + w / 0.95e9 / 400)
    # posted one after another (as before), each further server would add its ceil(w / 512 MiB) requests
    buckets = math.ceil(w / (512 << 20))
    assert buckets == 7 and ipc_push_s(model_dims(source), "bfloat16", servers=8, posted_at_once=1) == pytest.approx(
        w / 18.5e9 + 7 * buckets * 0.01 + w / 55e9)
    # the fitted recipe carries it, says why, and loads (colocated, the schema allows ipc)
    from rlrecipe.checks.fit_layout import Fit
    from rlrecipe.checks.fit_recipe import fitted_recipe

    text, recipe = fitted_recipe(Fit(source, Machine(1, 1, 80), [one]), one, tmp_path / "one.yaml")
    assert recipe.rollout.colocate and recipe.rollout.sglang.weight_sync == "ipc"
    header = " ".join(ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#"))
    assert "rollout.sglang.weight_sync disk -> ipc: every rank shares its copy of the weights by CUDA IPC" in header
    assert "not end to end with SGLang on a GPU" in header
    assert "the cheapest built push" in header and " by value and " in header
    (tmp_path / "one.yaml").write_text(text)
    assert load_recipe(tmp_path / "one.yaml").recipe.rollout.sglang.weight_sync == "ipc"
    # with the verification's copy into fresh pageable memory, as before (1.3 GB/s measured on an H100),
    # disk would be cheaper on one GPU: w / 18.5e9 + w / 1.3e9 (2.9 s) against 2.2 s
    assert w / 18.5e9 + w / 1.3e9 > w / 2e9 + w / 8e9
