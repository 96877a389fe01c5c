"""The colocated layout: its phase costs and per-phase memory by hand, and fit choosing it where it is faster."""

from __future__ import annotations

import pytest

from rlrecipe.checks.colocate import (
    ASSUMED,
    SGLANG_OUTSIDE_POOL_GIB,
    TRAINER_OFFLOADED_GIB,
    colocated_training,
    offloaded_bytes,
    phase_seconds,
)
from rlrecipe.checks.fit import Machine, Search, fit
from rlrecipe.checks.model_dims import GIB, ModelDims, model_dims
from rlrecipe.checks.plan import DS_REDUCE_BUCKET, plan, rank0_host_parts
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
    # ZeRO-Offload keeps the optimizer on the host already; offloaded parameters live there too
    assert offloaded_bytes(DIMS, "bfloat16", 4, True, True) == pytest.approx((2 + 4) * p / 4 + 2 * DS_REDUCE_BUCKET)
    # ZeRO-2: whole 16-bit parameters, no bucket kept
    assert offloaded_bytes(DIMS, "bfloat16", 4, False, False, 2) == pytest.approx(2 * p + (2 + 4 + 12) * p / 4)
    one = phase_seconds(DIMS, dtype="bfloat16", rollout_dtype="bfloat16", ranks=4, nodes=1, offload_optimizer=False,
                        offload_params=False)
    assert one == pytest.approx({"release": 1.0, "reload": moved / 20e9, "offload": moved / 20e9, "resume": 1.0,
                                 "push": 2 * p / (29.6e9 / 1.6), "verify": 0.5})
    # across nodes the gather crosses the network (25 GB/s a GPU); a slower push is divided, a time multiplied
    two = phase_seconds(DIMS, dtype="bfloat16", rollout_dtype="bfloat16", ranks=16, nodes=2, offload_optimizer=False,
                        offload_params=False, costs=ASSUMED.scaled(push_bytes_s=2, release_s=3))
    assert two["push"] == pytest.approx(2 * p / (29.6e9 / 1.6 / 2) + 2 * p / 25e9) and two["release"] == 3.0


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
    host = rank0_host_parts(r, d)["trainer state offloaded (pinned)"]
    assert host == pytest.approx(r.trainer.nproc * offloaded_bytes(d, r.model.dtype, 1, False, False))
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
    # on 24 GB the refusal's figure is the header's
    refusal = fit(source, Machine(1, 1, 24)).refusal
    least = min(Search(source, Machine(1, 1, 24)).train_options(1, 1, colocated=True), key=lambda o: o.peak)
    assert f"training phase needs {least.peak / GIB:.1f} GiB per GPU > 22.8 usable" in refusal
    assert f"needs {least.peak / GIB:.1f} GiB per GPU at its least" in header


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
    d = model_dims(loaded)
    assert parts["push"] == pytest.approx(2 * d.params() / ASSUMED.push_bytes_s)
