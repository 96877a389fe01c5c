"""The FP8 KV cache in plan, fit's rates and the 7B projection (bench/projection/fp8_kv.py), by hand."""

import math

import pytest

from bench.projection.fp8_kv import arm, fp8_projection, markdown
from rlrecipe.checks.gpu_costs import DECODE_SHARE
from rlrecipe.checks.model_dims import model_dims
from rlrecipe.checks.plan import kv_cache_tokens, rollout_budget
from rlrecipe.checks.step_time import Lengths, Rates
from rlrecipe.recipe.schema import load_recipe

C3PO = "recipes/7b_boba_icepop_c3po.yaml"
PARAMS = 7_615_616_512  # R1-Distill-Qwen-7B
POOL = int(0.80 * 80 * 2**30)  # mem_fraction_static x 80 GiB
KV_ELEMENTS = 2 * 28 * 4 * 128  # K and V, 28 layers x 4 kv heads x 128 dims


def test_an_fp8_cache_holds_twice_the_tokens_in_the_plan():
    bf16 = (POOL - 2 * PARAMS) // (KV_ELEMENTS * 2)
    fp8 = (POOL - 2 * PARAMS) // (KV_ELEMENTS * 1)
    assert (bf16, fp8) == (932_760, 1_865_521)
    assert kv_cache_tokens(load_recipe(C3PO, [])) == bf16
    assert kv_cache_tokens(load_recipe(C3PO, ["rollout.kv_cache_dtype=fp8_e4m3"])) == fp8
    assert kv_cache_tokens(load_recipe(C3PO, ["rollout.kv_cache_dtype=fp8_e5m2"])) == fp8
    # SGLang's own flag, without the field, counts the same
    assert kv_cache_tokens(load_recipe(C3PO, ["rollout.sglang.extra_args=[--kv-cache-dtype, fp8_e4m3]"])) == fp8


def test_the_in_process_engines_kv_cache_halves():
    def kv(overrides):
        loaded = load_recipe("recipes/tiny_rl.yaml", overrides)
        return rollout_budget(loaded.recipe, model_dims(loaded), "rl").parts["KV cache"]

    auto, fp8 = kv([]), kv(["rollout.kv_cache_dtype=fp8_e4m3"])
    dtype = load_recipe("recipes/tiny_rl.yaml").recipe.rollout.dtype
    assert auto == {"float32": 4, "bfloat16": 2}[dtype] * fp8


# what decoding reaches of an H100's HBM and bf16 peak: the datasheet at the share fitted to SGLang's cases
HBM, FLOPS = DECODE_SHARE * 3.35e12, DECODE_SHARE * 989e12


def test_a_context_token_costs_its_bytes_at_hbm_speed():
    dims = model_dims(load_recipe(C3PO))
    assert Rates.of(dims, "bfloat16", False, train_seq_len=1).ctx_s == pytest.approx(57_344 / HBM)
    assert Rates.of(dims, "bfloat16", False, train_seq_len=1, kv_bytes=1).ctx_s == pytest.approx(28_672 / HBM)


def test_the_decode_bound_with_the_cache_full_by_hand():
    lengths = Lengths.assumed(27_648, 1024)
    occupancy = 512 + lengths.mean / 2  # half the 1024 prompt tokens, half the mean response
    step = 2 * PARAMS / HBM + 1.2e-3  # the bf16 weights read once, plus the step's overhead
    row = 2 * PARAMS / FLOPS
    for label, tokens, kv_b in (("bf16", 932_760, 2), ("fp8", 1_865_521, 1)):
        rows = math.floor(tokens / occupancy)
        by_hand = (step + KV_ELEMENTS * kv_b / HBM * rows * occupancy) / rows + row
        got = arm(C3PO, "auto" if label == "bf16" else "fp8_e4m3")
        assert got["rows_cache_full"] == rows and got["kv_tokens_per_engine"] == tokens
        assert got["decode_us_per_token_per_gpu"] == pytest.approx(by_hand * 1e6)


def test_the_projection_keeps_training_and_speeds_the_rollout():
    res = fp8_projection()
    for name in ("7b_boba", "7b_boba_icepop_c3po"):
        assert res[f"{name}_bf16_train_s"] == res[f"{name}_fp8_train_s"]
        assert res[f"{name}_bf16_kv_bytes_per_token"] == 2 * res[f"{name}_fp8_kv_bytes_per_token"] == 57_344
        # weights per token halve with twice the rows, KV per token halves, rows' compute stays
        assert 1 < res[f"{name}_fp8_decode_speedup"] < 2
        assert 1 < res[f"{name}_fp8_step_speedup_per_trained_token"] < res[f"{name}_fp8_rollout_speedup"]
    assert "| 7b_boba | fp8 vs bf16 |" in markdown(res)
