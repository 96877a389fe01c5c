"""trainer.lora in plan, fit and the step time: the adapter's size by hand, what the plan counts (the base
frozen, the adapter alone training, its push, the colocated base kept in both phases), the one-GPU answers
for the shipped LoRA recipes, and full fine-tuning unchanged."""

from __future__ import annotations

import pytest

from rlrecipe.checks.colocate import ASSUMED, allowed_pushes, phase_seconds, push_seconds
from rlrecipe.checks.fit import fit
from rlrecipe.checks.fit_layout import Machine
from rlrecipe.checks.fit_refusal import first_failure
from rlrecipe.checks.fit_search import Search
from rlrecipe.checks.gpu_costs import TRAIN_SHARE
from rlrecipe.checks.host_disk import footprint
from rlrecipe.checks.memory import DS_REDUCE_BUCKET, SGLANG_ADAPTER_SLOTS, lora_params, offloaded_bytes
from rlrecipe.checks.model_dims import GIB, ModelDims, model_dims
from rlrecipe.checks.plan import plan, train_budget
from rlrecipe.checks.step_time import H100, LORA_DECODE_SLOWDOWN, Lengths, Rates, rollout_step, training_step
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import load_recipe
from tests.conftest import REPO

# Qwen2 1.5B (DeepSeek-R1-Distill-Qwen-1.5B's config)
QWEN_1_5B = ModelDims(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, tied=False)
LORA_1_5B = "recipes/1.5b_boba_icepop_c3po_lora_1x24gb.yaml"
LORA_7B = "recipes/7b_boba_icepop_c3po_lora_1x48gb.yaml"
FULL_1_5B = "recipes/1.5b_boba_icepop_c3po_1x80gb.yaml"
# the 7B recipe's one-GPU batch, as the shipped LoRA recipe's header's fit command sets it
ONE_GPU_BATCH = ["rl.prompts_per_step=128", "rl.samples_per_prompt=8", "rollout.max_new_tokens=8192",
                 "rl.c3po.token_budget=4000000", "rl.c3po.pool_capacity=2048"]
LORA = ["trainer.lora.alpha=32", "trainer.lr=2e-4"]


def _load(path: str, sets: list[str] | None = None):
    return load_recipe(REPO / path, sets or [])


def test_adapter_parameters_of_qwen2_1_5b_by_hand():
    # per block, rank x (in + out) for each linear: q 1536 -> 1536 (12 heads x 128), k and v 1536 -> 256
    # (2 KV heads x 128), o 1536 -> 1536, gate and up 1536 -> 8960, down 8960 -> 1536
    per_rank_block = (1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 2 * (1536 + 8960) + (8960 + 1536)
    assert per_rank_block == 41_216
    assert QWEN_1_5B.lora_params(32) == 28 * 32 * 41_216 == 36_929_536
    assert QWEN_1_5B.lora_params(8, ["q_proj", "v_proj"]) == 28 * 8 * (3072 + 1792)
    with pytest.raises(UserError, match="lm_head not among"):
        QWEN_1_5B.lora_params(8, ["q_proj", "lm_head"])


def test_lora_training_phase_counts_the_adapter_alone():
    loaded = _load(LORA_1_5B)
    r, d = loaded.recipe, model_dims(loaded)
    p, t = d.params(), lora_params(r, d)
    assert t == 36_929_536
    parts = train_budget(r, d).parts
    # ZeRO-3 on one rank, float16: the whole frozen base plus what it keeps gathered (1.05e9 at most)
    assert parts["base parameters (frozen)"] == pytest.approx(2 * p + 2 * 1.05e9)
    assert parts["adapter parameters"] == parts["adapter gradients"] == pytest.approx(2 * t)
    assert parts["adapter optimizer"] == pytest.approx(12 * t)  # fp32 master, m and v: the adapter's only
    assert parts["fp32 gradient copy"] == pytest.approx(4 * t)
    assert parts["reduce bucket"] == pytest.approx(2 * DS_REDUCE_BUCKET)  # allocated whole on CUDA
    assert parts["embedding grad"] == 0  # the embedding is frozen
    # colocated: the released server keeps its weights (and its adapter slots) beside the trainer
    assert parts["SGLang weights (kept)"] == pytest.approx(2 * p)
    assert parts["SGLang adapter slots (kept)"] == pytest.approx(SGLANG_ADAPTER_SLOTS * 2 * t)
    assert "gradients" not in parts and "reference model" not in parts


def test_lora_rollout_phase_keeps_the_trainers_base_and_the_pool_holds_the_adapter_slots():
    loaded = _load(LORA_1_5B)
    d = model_dims(loaded)
    p, t = d.params(), lora_params(loaded.recipe, d)
    _, _, budgets = plan(loaded)
    rollout, phase = budgets[1].parts, budgets[2].parts
    assert phase["trainer's frozen base and adapter (kept)"] == pytest.approx(2 * (p + t))
    assert rollout["adapter slots"] == pytest.approx(2 * 2 * t)
    assert rollout["weights"] + rollout["adapter slots"] + rollout["KV cache"] == pytest.approx(0.5 * 24 * GIB)
    assert all(b.fits for b in budgets)


def test_lora_kl_reference_is_the_base_no_second_model():
    loaded = _load(LORA_1_5B, ["rl.kl_coef=0.01"])
    budget = train_budget(loaded.recipe, model_dims(loaded))
    assert "reference model" not in budget.parts
    assert any("adapter off, no second model" in n for n in budget.notes)
    full = _load(FULL_1_5B, ["rl.kl_coef=0.01"])
    assert "reference model" in train_budget(full.recipe, model_dims(full)).parts


def test_lora_checkpoints_hold_the_adapter_and_its_optimizer_only():
    loaded = _load(LORA_1_5B)
    r, d = loaded.recipe, model_dims(loaded)
    t = lora_params(r, d)
    outside = footprint(r, d)
    ckpt = outside.checkpoint
    assert ckpt["trainer state (the adapter's)"] == 12 * t and ckpt["adapter (PEFT)"] == 2 * t
    assert "weights (HF export)" not in ckpt
    disk = outside.disk
    assert disk["adapter for the rollout servers"] == 2 * t  # weight_sync disk: the adapter, not the weights
    assert disk["final export"] == 4 * d.params() + 2 * t  # the merged model in float32, the adapter beside it
    host = outside.host
    assert host["trainer state offloaded (pinned)"] == pytest.approx(offloaded_bytes(d, "float16", 1, False, False,
                                                                                     3, t))


def test_lora_offload_moves_the_adapters_state_and_the_bucket_only():
    p, t = QWEN_1_5B.params(), 1_000_000
    # ZeRO-3 over 4 ranks, 16-bit: the adapter's gradients (2), fp32 gradients (4), optimizer (12), a
    # quarter each, and the reduce bucket; no weights
    moved = (2 + 4 + 12) * t / 4 + 2 * DS_REDUCE_BUCKET
    assert offloaded_bytes(QWEN_1_5B, "bfloat16", 4, False, False, 3, t) == pytest.approx(moved)
    assert offloaded_bytes(QWEN_1_5B, "bfloat16", 4, False, False) > 2 * p / 4  # full fine-tuning: the weights too
    phases = phase_seconds(QWEN_1_5B, dtype="bfloat16", ranks=4, offload_optimizer=False, offload_params=False,
                           push_s=0.0, adapter=t)
    assert phases["reload"] == phases["offload"] == pytest.approx(moved / ASSUMED.offload_bytes_s)


def test_adapter_push_by_hand():
    t = QWEN_1_5B.lora_params(32)
    seconds = push_seconds(QWEN_1_5B, "float16", servers=1, tp=1, params=t)
    w = 2 * t  # 73.9 MB in float16
    assert w == pytest.approx(73.86e6, rel=1e-4)
    assert seconds["tensor"] == pytest.approx(w / 0.25e9)  # /load_lora_adapter_from_tensors: 0.30 s
    assert seconds["disk"] == pytest.approx(w / 2e9 + w / 8e9)  # a PEFT directory written, then loaded: 0.05 s
    assert allowed_pushes(colocated=True, lora=True) == ("tensor", "disk")


def test_lora_training_step_skips_the_frozen_weight_gradients():
    d = QWEN_1_5B
    full = Rates.of(d, "bfloat16", True, train_seq_len=8192)
    lora = Rates.of(d, "bfloat16", True, train_seq_len=8192, lora=True)
    # backward without the frozen weights' gradients: 2N FLOP a token less, at the fitted training share
    assert full.train_token_s - lora.train_token_s == pytest.approx(2 * d.params() / (TRAIN_SHARE * 989e12))
    t = d.lora_params(32)
    kw = dict(trained_tokens=1e6, ranks=1, nodes=1, dtype="bfloat16", zero_stage=3, offload_optimizer=False,
              offload_params=False, microbatch_tokens=9216, chunk_tokens=1024, minibatches=4)
    step = training_step(lora, d, trained_params=t, **kw)
    assert step.parts["step and push"] == pytest.approx(3.0 + 2 * t / H100.weight_push_bytes_s)
    assert training_step(full, d, **kw).parts["step and push"] == pytest.approx(3.0 + 2 * d.params() / 8e9)


def test_lora_decoding_through_sglang_takes_the_published_slowdown():
    """trainer.lora with SGLang rollouts: every decoding term is LORA_DECODE_SLOWDOWN (1.5, vLLM's rank-8
    Llama-2-7B throughput with and without LoRA, 2,693.62 against 1,787.78 output tokens/s) times the
    base's; the prefill is not."""
    assert LORA_DECODE_SLOWDOWN == 1.5 and 2693.62 / 1787.78 == pytest.approx(LORA_DECODE_SLOWDOWN, abs=0.01)
    with_lora = Search(_load(LORA_1_5B), Machine(1, 1, 24))
    without = Search(_load(LORA_1_5B, ["trainer.lora.rank=0"]), Machine(1, 1, 24))
    lora, full = with_lora.rates, without.rates
    for term in ("step_s", "row_s", "ctx_s"):
        assert getattr(lora, term) == pytest.approx(LORA_DECODE_SLOWDOWN * getattr(full, term), rel=1e-12)
    assert lora.prefill_token_s == full.prefill_token_s
    # one step's rollout on the same engine: decoding 1.5 x, the prefill of the resumed pool as before
    lengths = Lengths.assumed(8192, 1024)
    kw = dict(engines=1, tp=1, kv_tokens=320_277, rollouts=1024, max_concurrency=2048, c3po_budget=4_000_000,
              c3po_pool=2048)
    prefill = rollout_step(Rates(0, 0, 0, full.prefill_token_s, 0), lengths, **kw).seconds
    a, b = rollout_step(lora, lengths, **kw).seconds, rollout_step(full, lengths, **kw).seconds
    assert (a - prefill) == pytest.approx(LORA_DECODE_SLOWDOWN * (b - prefill), rel=1e-12)
    assert b == pytest.approx(216, abs=1) and a == pytest.approx(323, abs=1)


def test_fit_lays_out_1_5b_lora_on_one_24gb_gpu_slower_than_full_fine_tuning():
    # full fine-tuning is refused on 12 GB (12.4 GiB > 11.4: tests/checks/test_colocate.py) and fits 16 GB
    full = fit(_load(FULL_1_5B), Machine(1, 1, 12))
    assert full.refusal and "the training phase needs 12.4 GiB per GPU > 11.4" in full.refusal
    assert fit(_load(FULL_1_5B), Machine(1, 1, 16)).layouts
    # on 24 GB (13.0 GiB at its least) it fits, ZeRO-3 with the optimizer offloaded, at about 456 s a step
    whole = fit(_load(FULL_1_5B), Machine(1, 1, 24)).layouts[0]
    assert whole.colocated and (whole.train.zero_stage, whole.train.offload_optimizer) == (3, True)
    loaded = _load(FULL_1_5B, ["trainer.lora.rank=32", *LORA])
    best = fit(loaded, Machine(1, 1, 24)).layouts[0]
    assert best.colocated and best.push == "disk" and best.train.label == "Z3 9k x 128 c1024"
    assert best.train.peak / GIB == pytest.approx(22.22, abs=0.01) and best.rollout.mem_fraction == 0.5
    # the rollout 216 s at the base's decoding, 323 s through the adapter (decoding 1.5 x), training 211
    assert best.rollout.time.seconds == pytest.approx(323, abs=1) and best.train.time.seconds == pytest.approx(211, abs=1)
    assert best.step_s == pytest.approx(534, abs=1) and best.hours == pytest.approx(59, abs=0.5)
    # full fine-tuning decodes the merged weights at the base's speed, with a larger KV cache: faster here
    assert best.step_s > whole.step_s == pytest.approx(456, abs=1)


def test_fit_on_one_48gb_gpu_7b_lora_rank_8_fits_rank_64_is_refused_with_the_numbers():
    # the adapter has 2,523,136 parameters a unit of rank: 28 blocks x 90,112 (q and o 3584 + 3584, k and v
    # 3584 + 512, gate and up 3584 + 18944, down 18944 + 3584); with the optimizer offloaded its 16-bit and fp32 gradients (6 bytes a parameter) are in host memory.
    # Rank 64: 46.8 GiB while the plan counted them on the GPU, less 6 x 161.5M (0.90 GiB): 45.9
    rank64 = _load("recipes/7b_boba_icepop_c3po.yaml", [*ONE_GPU_BATCH, "trainer.lora.rank=64", *LORA])
    search = Search(rank64, Machine(1, 1, 48))
    assert search.layouts() == []
    assert "the training phase needs 45.9 GiB per GPU > 45.6 usable" in first_failure(search)
    # rank 32 (45.9 less 6 x 80.7M, 0.45 GiB: 45.4) now fits
    rank32 = _load("recipes/7b_boba_icepop_c3po.yaml", [*ONE_GPU_BATCH, "trainer.lora.rank=32", *LORA])
    assert Search(rank32, Machine(1, 1, 48)).layouts()
    # rank 8: ZeRO-3 with the adapter's optimizer offloaded and log-prob chunks of 1024, 45.63 GiB while its
    # gradients were counted on the GPU (over 45.6), less 6 x 20.19M (0.11 GiB): 45.52, now fits and is the
    # fastest (without offload it needs chunks of 512, 45.43)
    rank8 = _load("recipes/7b_boba_icepop_c3po.yaml", [*ONE_GPU_BATCH, "trainer.lora.rank=8", *LORA])
    assert 2 * (3584 + 3584) + 2 * (3584 + 512) + 2 * (3584 + 18944) + 18944 + 3584 == 90_112
    assert lora_params(rank8.recipe, model_dims(rank8)) == 8 * 28 * 90_112 == 8 * 2_523_136
    best = Search(rank8, Machine(1, 1, 48)).layouts()[0]
    assert best.colocated and best.train.label == "Z3+o 9k x 128 c1024"
    assert best.train.peak / GIB == pytest.approx(45.63 - 6 * 8 * 2_523_136 / GIB, abs=0.01)
    # rollout 1,023 s (decoding 1.5 x the base's), training 801: 1,824 s a step, 203 h (165 at the base's decoding)
    assert best.step_s == pytest.approx(1824, abs=1) and best.hours == pytest.approx(203, abs=0.5)


@pytest.mark.parametrize("path, machine", [(LORA_1_5B, Machine(1, 1, 24)), (LORA_7B, Machine(1, 1, 48))],
                         ids=["1.5b_24gb", "7b_48gb"])
def test_shipped_lora_recipes_are_fits_first_layout(path, machine):
    loaded = _load(path)
    r = loaded.recipe
    best = Search(loaded, machine).layouts()[0]
    t, ro = best.train, best.rollout
    assert r.trainer.lora.enabled and r.trainer.lora.target_modules == "all-linear" and r.trainer.lr == 2e-4
    assert r.rollout.colocate and r.rollout.sglang.weight_sync == best.push
    assert (r.trainer.zero_stage, r.trainer.offload_optimizer, r.trainer.offload_params) == \
        (t.zero_stage, t.offload_optimizer, t.offload_params)
    assert (r.trainer.max_tokens_per_microbatch, r.trainer.logprob_chunk_tokens) == (t.microbatch_tokens, t.chunk_tokens)
    assert (r.rollout.sglang.tp_size, r.rollout.sglang.mem_fraction_static) == (ro.tp, ro.mem_fraction)
    head = (REPO / path).read_text()
    assert "NOTHING OF IT HAS RUN ON A GPU" in head and f"{best.hours:.0f} h" in head


@pytest.mark.parametrize("path, totals", [("recipes/7b_boba.yaml", (24.52, 64.00)),
                                          (FULL_1_5B, (53.61, 72.00, 79.50)),
                                          # the training 33.39 less ZeRO-Offload's gradient partitions, now
                                          # on the host: 6 bytes x 7.616B / 8 ranks, 5.32 GiB
                                          ("recipes/7b_boba_8x40gb.yaml", (28.07, 32.00, 39.50))],
                         ids=["7b_boba", "1.5b_1x80gb", "7b_8x40gb"])
def test_full_fine_tuning_plans_unchanged(path, totals):
    """The totals `rlrecipe plan` printed before LoRA was counted; rank 0 set explicitly changes nothing."""
    for sets in ([], ["trainer.lora.rank=0"]):
        budgets = plan(_load(path, sets))[2]
        assert tuple(round(b.total / GIB, 2) for b in budgets) == totals
