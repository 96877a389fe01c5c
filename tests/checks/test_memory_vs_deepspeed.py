"""The plan's model-state memory per GPU against DeepSpeed's own estimators.

`estimate_zero2_model_states_mem_needs_all_cold` and `estimate_zero3_model_states_mem_needs_all_cold`
(deepspeed/runtime/zero/stage_1_and_2.py, stage3.py) print, per GPU, what the weights, gradients and
optimizer state of a model of P parameters take on N GPUs; they run on CPU from parameter counts. For
Qwen2.5 0.5B (its published shape), R1-Distill-Qwen 1.5B, 7B and 32B (the shipped configs), at ZeRO-2
and ZeRO-3, with and without optimizer (and ZeRO-3 parameter) offload, on 8, 16 and 64 GPUs, the plan's
parts must equal DeepSpeed's on the terms both count, to the byte (DeepSpeed truncates with int()):

  ZeRO-2          2 P (16-bit weights, whole) + 18 P / N (16-bit and fp32 gradients, fp32 master
                  weights, m and v), as the estimator's own comment lists them
  ZeRO-2 offload  2 P: the gradients and the optimizer live in host memory
  ZeRO-3          18 P / N: the 16-bit partition, fp32 master weights, m and v, fp32 gradients
  ZeRO-3 offload  2 P / N (the 16-bit partition), and nothing with the parameters offloaded too

Where they differ by design, the test pins each side's term by its own formula and says why:

  - what ZeRO-3 holds gathered: DeepSpeed's estimator takes 4 bytes x its largest layer (the embedding,
    V x hidden); the plan takes what DeepSpeed's defaults let ZeRO-3 keep gathered, the model dtype x
    min(P, stage3_max_live_parameters + stage3_prefetch_bucket_size), read here from DeepSpeed's own
    config defaults;
  - ZeRO-3's 16-bit gradient partition (2 P / N): stage3.py keeps it whole between micro-batches in
    grad_partitions_flat_buffer (in the gradient accumulation dtype, which the engine makes the model's)
    and makes the fp32 gradients from it at the step; the estimator's 18 bytes leave it out. The plan
    counts both;
  - ZeRO-2 offload's staging buffer: stage_1_and_2.py allocates temp_grad_buffer_for_gpu_offload on the
    GPU, the size of the largest trained tensor in the model dtype; the estimator leaves it out, the
    plan counts it;
  - DeepSpeed's additional_buffer_factor (1.5) multiplies only its CPU figures. Those are compared apart
    (test_offloaded_optimizer_host_memory_matches_deepspeed) with the factor divided out: the plan's host
    memory under ZeRO-Offload (host_disk.py) counts the 16 bytes a partitioned parameter DeepSpeed's do,
    and from ZeRO-2 the 16-bit gradient partition beside them, not a 1.5 margin.

Under LoRA the same holds for the adapter's states (DeepSpeed's estimator given the adapter's parameter
count); the frozen base (16-bit, ZeRO-3 partitioned and gathered as above) is the plan's alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlrecipe.checks.memory import DS_MAX_LIVE_PARAMETERS, DS_PREFETCH_BUCKET, lora_params
from rlrecipe.checks.model_dims import GIB, SHIPPED_CONFIGS, ModelDims, _hub_config
from rlrecipe.checks.plan import train_budget
from rlrecipe.recipe.schema import load_recipe

zero2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")

REPO = Path(__file__).resolve().parents[2]
# Qwen2.5-0.5B as published (its config.json): 494,032,768 parameters
QWEN_0_5B = ModelDims(vocab=151936, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, tied=True)
MODELS = {"0.5B": QWEN_0_5B} | {
    size: ModelDims.from_config(_hub_config(f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{size}", None))
    for size in ("1.5B", "7B", "32B")}
LAYOUTS = [(8, 1), (8, 2), (8, 8)]  # GPUs a node, nodes
OFFLOADS = {2: [(False, False), (True, False)], 3: [(False, False), (True, False), (True, True)]}
CASES = [(m, s, opt, par, g, nodes) for m in MODELS for s in (2, 3) for opt, par in OFFLOADS[s]
         for g, nodes in LAYOUTS]
MODEL_STATES = ("parameters", "gradients", "optimizer", "fp32 gradient copy", "offload staging buffer",
                "adapter parameters", "adapter gradients", "adapter optimizer")


def test_the_half_billion_model_has_its_published_size():
    assert SHIPPED_CONFIGS.exists()
    assert QWEN_0_5B.params() == 494_032_768


def recipe(stage: int, opt: bool, par: bool, gpus: int, nodes: int, lora_rank: int = 0):
    sets = [f"trainer.zero_stage={stage}", f"trainer.offload_optimizer={str(opt).lower()}",
            f"trainer.offload_params={str(par).lower()}", f"trainer.nproc={gpus}", f"trainer.nodes={nodes}",
            "model.dtype=bfloat16"]
    if lora_rank:
        sets.append(f"trainer.lora.rank={lora_rank}")
    return load_recipe(REPO / "recipes/7b_boba.yaml", sets).recipe


def largest_layer(d: ModelDims) -> int:
    """The most parameters one module of a Qwen2 model holds itself (stage3.py's model_to_params): the
    embedding (or the head), V x hidden, beside an MLP projection's intermediate x hidden."""
    return max(d.vocab, d.intermediate) * d.hidden


def largest_adapter_layer(d: ModelDims, rank: int) -> int:
    """Under LoRA DeepSpeed's modules with trained parameters are the adapter's A and B: the largest,
    gate/up's B (intermediate x rank) or down's A (rank x intermediate)."""
    return rank * max(d.intermediate, d.hidden)


def zero3_gathered_default() -> int:
    """Parameters ZeRO-3 may keep gathered under DeepSpeed's defaults (its config, not the plan's copy)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = DeepSpeedZeroConfig()
    return cfg.max_live_parameters + cfg.prefetch_bucket_size


def deepspeed_gpu(p: int, largest: int, stage: int, opt: bool, par: bool, gpus: int, nodes: int) -> int:
    """DeepSpeed's per-GPU bytes for the model states, the figure its _all_cold estimators print."""
    if stage == 2:
        return zero2.estimate_zero2_model_states_mem_needs(p, gpus, nodes, cpu_offload=opt)[1]
    return zero3.estimate_zero3_model_states_mem_needs(p, largest, gpus, nodes, cpu_offload=opt,
                                                        cpu_offload_params=par)[1]


def printed_gpu_gib(capsys, p: int, largest: int, stage: int, opt: bool, par: bool, gpus: int, nodes: int) -> float:
    """The per-GPU figure the _all_cold estimator prints for this option (2 decimals, GB = GiB). Its
    option column spells the CPU "OffloadDeviceEnum.cpu" or "cpu" by Python version."""
    def dev(on: bool) -> str:
        return r"\S*cpu" if on else "none"

    if stage == 2:
        zero2.estimate_zero2_model_states_mem_needs_all_cold(p, gpus, nodes)
        want = rf"offload_optimizer={dev(opt)}$"
    else:
        zero3.estimate_zero3_model_states_mem_needs_all_cold(p, largest, gpus, nodes)
        want = rf"offload_param={dev(par)}, offload_optimizer={dev(opt)}, zero_init=1$"
    for line in capsys.readouterr().out.splitlines():
        if re.search(want, line.rstrip()):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(f"{want} not printed")


def plan_states(stage: int, opt: bool, par: bool, gpus: int, nodes: int, d: ModelDims, lora_rank: int = 0):
    parts = train_budget(recipe(stage, opt, par, gpus, nodes, lora_rank), d).parts
    return {k: v for k, v in parts.items() if k in MODEL_STATES}


def design_terms(d: ModelDims, largest: int, stage: int, opt: bool, gpus: int, nodes: int) -> tuple[float, float]:
    """(the plan's bytes, DeepSpeed's bytes) on the terms where they differ by design (module docstring),
    each side's by its own formula, in bfloat16."""
    n, b = gpus * nodes, 2
    if stage == 2:
        return (b * largest if opt else 0.0), 0.0  # the offload staging buffer: the embedding
    plan = b * min(d.params(), zero3_gathered_default())  # what ZeRO-3 keeps gathered
    if not opt:
        plan += b * d.params() / n  # the 16-bit gradient partition
    return plan, 4.0 * largest


@pytest.mark.parametrize("model,stage,opt,par,gpus,nodes", CASES)
def test_model_states_match_deepspeed(capsys, model, stage, opt, par, gpus, nodes):
    d = MODELS[model]
    p, largest = d.params(), largest_layer(d)
    ds = deepspeed_gpu(p, largest, stage, opt, par, gpus, nodes)
    assert printed_gpu_gib(capsys, p, largest, stage, opt, par, gpus, nodes) == pytest.approx(ds / GIB, abs=0.006)
    states = plan_states(stage, opt, par, gpus, nodes, d)
    plan = sum(states.values())
    plan_own, ds_own = design_terms(d, largest, stage, opt, gpus, nodes)
    # DeepSpeed's DS_* defaults copied into memory.py are DeepSpeed's own
    assert DS_MAX_LIVE_PARAMETERS + DS_PREFETCH_BUCKET == zero3_gathered_default()
    assert plan - plan_own == pytest.approx(ds - ds_own, abs=1.0), (model, stage, opt, par, gpus, nodes, states)


LORA_CASES = [(m, s, opt, 8, 1) for m in ("1.5B", "7B") for s in (2, 3) for opt in (False, True)]


@pytest.mark.parametrize("model,stage,opt,gpus,nodes", LORA_CASES)
def test_lora_adapter_states_match_deepspeed(model, stage, opt, gpus, nodes):
    """The adapter's parameters, gradients and optimizer state against DeepSpeed's estimator given the
    adapter's parameter count (rank 64, all seven linear layers of every block); the frozen base aside."""
    d, rank = MODELS[model], 64
    r = recipe(stage, opt, False, gpus, nodes, rank)
    adapter = lora_params(r, d)
    largest = largest_adapter_layer(d, rank)
    ds = deepspeed_gpu(adapter, largest, stage, opt, False, gpus, nodes)
    states = plan_states(stage, opt, False, gpus, nodes, d, rank)
    states.pop("parameters", None)  # the frozen base ("base parameters (frozen)" is not among MODEL_STATES)
    plan = sum(states.values())
    n = gpus * nodes
    plan_own = (2 * adapter / n if stage == 3 and not opt else 0.0) + (2 * largest if stage == 2 and opt else 0.0)
    ds_own = 4 * largest if stage == 3 else 0.0
    assert plan - plan_own == pytest.approx(ds - ds_own, abs=1.0), (model, stage, opt, states)


# ZeRO-2's estimator takes max(4 x all GPUs, 16) bytes a parameter a node (its first term what every rank
# loads before partitioning): 16 only up to 4 GPUs in all
HOST_CASES = [(m, 2, 4, 1) for m in MODELS] + [(m, 3, g, nodes) for m in MODELS for g, nodes in LAYOUTS]


@pytest.mark.parametrize("model,stage,gpus,nodes", HOST_CASES)
def test_offloaded_optimizer_host_memory_matches_deepspeed(model, stage, gpus, nodes):
    """A node's host memory under ZeRO-Offload (optimizer only): DeepSpeed's estimator gives 16 bytes a
    parameter of its ranks' partitions (fp32 master weights 4, m and v 8, fp32 gradients 4) times its
    additional_buffer_factor, 1.5; the plan counts the 16 bytes without the factor and, from ZeRO-2, the
    16-bit gradient partition beside them (2 bytes: stage3.py's grad_partitions_flat_buffer on the
    optimizer's device), which the estimator leaves to its factor."""
    from rlrecipe.checks.host_disk import footprint

    d = MODELS[model]
    p = d.params()
    factor = 1.5  # the estimators' default additional_buffer_factor
    if stage == 2:
        ds = zero2.estimate_zero2_model_states_mem_needs(p, gpus, nodes, cpu_offload=True,
                                                         additional_buffer_factor=factor)[0]
    else:
        ds = zero3.estimate_zero3_model_states_mem_needs(p, largest_layer(d), gpus, nodes, cpu_offload=True,
                                                         cpu_offload_params=False,
                                                         additional_buffer_factor=factor)[0]
    host = footprint(recipe(stage, True, False, gpus, nodes), d).host
    assert host["optimizer and fp32 gradients offloaded"] == pytest.approx(ds / factor, abs=1.0)
    assert host["optimizer and fp32 gradients offloaded"] == pytest.approx(16 * p / nodes)
    assert host["gradient partition offloaded"] == pytest.approx(2 * p / nodes)
    # without the 12 bytes of the optimizer state alone, as before: 4 bytes a parameter short of DeepSpeed
    assert 12 * p / nodes < ds / factor


def comparison_rows():
    """The table docs/gpu.md quotes: model, stage, offload, GPUs, the plan's and DeepSpeed's GiB."""
    rows = []
    for model, stage, opt, par, gpus, nodes in CASES:
        d = MODELS[model]
        ds = deepspeed_gpu(d.params(), largest_layer(d), stage, opt, par, gpus, nodes)
        plan = sum(plan_states(stage, opt, par, gpus, nodes, d).values())
        off = "optimizer+params" if par else "optimizer" if opt else "none"
        rows.append((model, stage, off, gpus * nodes, plan / GIB, ds / GIB))
    return rows


if __name__ == "__main__":
    print("| model | ZeRO | offload | GPUs | plan GiB | DeepSpeed GiB |\n|---|---|---|---|---|---|")
    for row in comparison_rows():
        print("| {} | {} | {} | {} | {:.2f} | {:.2f} |".format(*row))
