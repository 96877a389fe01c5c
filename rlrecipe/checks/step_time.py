"""Seconds of an RL step on a layout, in closed form: what `rlrecipe fit` ranks layouts by.

The same cost model as the simulated projections (bench/projection/cost_model.py): an H100's datasheet
at the shares fitted to published measurements (gpu_costs.py), with the rollout summed over a length
distribution instead of replayed decoding step by decoding step, so that thousands of layouts cost
milliseconds. docs/gpu.md ("How fit decides") gives the formulas with a worked example. Projections for
ranking layouts, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from rlrecipe.checks.gpu_costs import DECODE_SHARE, DEVICES, STEP_OVERHEAD_S, TRAIN_SHARE, token_flops
from rlrecipe.checks.model_dims import BYTES, ModelDims


@dataclass(frozen=True)
class GPU:
    """What the times assume of every GPU, whatever its memory: an H100 SXM. Decoding and training
    rates are the datasheet's at the fitted shares (gpu_costs.py); the links, the host and the push
    are assumptions."""

    hbm_bytes_s: float = DEVICES["H100"].hbm_bps
    bf16_flop_s: float = DEVICES["H100"].bf16_flops
    decode_overhead_s: float = STEP_OVERHEAD_S  # scheduling, sampling, launches per decoding step
    decode_share: float = DECODE_SHARE  # of HBM and of the bf16 peak: decoding and prefill (fitted)
    train_share: float = TRAIN_SHARE  # of the bf16 peak, at torchtitan's FLOP count (fitted)
    nvlink_bytes_s: float = 150e9  # collective bus bandwidth inside a node
    network_bytes_s: float = 25e9  # per GPU between nodes (200 Gb/s)
    pcie_bytes_s: float = 20e9  # GPU <-> host, offload
    cpu_adam_params_s: float = 1.0e9  # DeepSpeed's CPU Adam over one node's cores
    weight_push_bytes_s: float = 8e9  # weights to the rollout engines, and their load (async)


H100 = GPU()

# A response's length: log-normal around a median of MEDIAN_OF_MAX x max_new_tokens (10,000 of the
# 7B recipes' 27,648), sigma 0.4 between prompts and 0.45 between a prompt's samples (combined
# below), cut at max_new_tokens: the projection's assumed distribution (docs/async_projection.md).
MEDIAN_OF_MAX = 10_000 / 27_648
SIGMA = math.hypot(0.4, 0.45)
QUANTILES = 200
# Prompt tokens of a rollout: half of data.max_prompt_tokens (an assumption; boba's are shorter).
PROMPT_OF_MAX = 0.5
# Tokens a packed micro-batch holds on average, of trainer.max_tokens_per_microbatch: whole
# sequences of ~12k tokens into 30k leave some room unused (an assumption).
PACKING_FILL = 0.85
# The head's log-prob and entropy chunks: one kernel sequence each (an assumption).
CHUNK_OVERHEAD_S = 5e-4
# Step's fixed work: optimizer and bookkeeping, beyond the weight push (the projection's 5 s
# train_step_s less the 2 s push at 7B).
STEP_OVERHEAD_S = 3.0
# Under trainer.lora SGLang serves the base with the adapter unmerged, named per request (lora_path):
# every adapted layer adds its shrink and expand kernels to each decoding step. ASSUMPTION: decoding
# takes this many times the base's time. No SGLang measurement isolating decode against the base was
# found; the published figures: vLLM's benchmark_throughput with a rank-8 adapter on Llama-2-7B, one
# A100, ShareGPT prompts, 2,693.62 output tokens/s without LoRA and 1,787.78 with it (1.51x;
# vllm-project/vllm PR #11267, "[misc] benchmark_throughput : Add LoRA", 2024-12-17), the offline,
# throughput-bound case closest to a rollout; around it, vLLM on one TPU v6e, Llama 3.1 8B, 8.4% to
# 23.9% lower throughput with LoRA (1.09x to 1.31x; vllm-project/vllm PR #15655), and SGLang's own
# triton backend, median end-to-end latency about 2x the base's at 4 requests/s and 3x at 8
# (sgl-project/sglang PR #10286, Llama-3.1-8B-Instruct, one adapter), before the csgmv backend that PR
# introduced (20% to 80% lower latency than triton, SGLang's LoRA docs) became the default (PR #11488).
# Range 1.1 to 2.0. Measure: a server's decode throughput with and without --enable-lora and lora_path.
LORA_DECODE_SLOWDOWN = 1.5


@dataclass(frozen=True)
class Lengths:
    """Response lengths at QUANTILES evenly spaced quantiles of the assumed distribution."""

    max_new: int
    prompt: float
    values: tuple[float, ...]

    @classmethod
    def assumed(cls, max_new_tokens: int, max_prompt_tokens: int) -> Lengths:
        median = MEDIAN_OF_MAX * max_new_tokens
        dist = NormalDist(math.log(median), SIGMA)
        values = tuple(min(float(max_new_tokens), math.exp(dist.inv_cdf((i + 0.5) / QUANTILES)))
                       for i in range(QUANTILES))
        return cls(max_new_tokens, PROMPT_OF_MAX * max_prompt_tokens, values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def mean_square(self) -> float:
        return sum(v * v for v in self.values) / len(self.values)

    def longest_of(self, n: int) -> float:
        """The expected longest of n draws: the 1 - 1/(n + 1) quantile."""
        dist = NormalDist(math.log(MEDIAN_OF_MAX * self.max_new), SIGMA)
        return min(float(self.max_new), math.exp(dist.inv_cdf(1 - 1 / (n + 1))))

    @property
    def sequence(self) -> float:
        """A trained sequence's tokens on average: its prompt and its response."""
        return self.prompt + self.mean

    @property
    def context_per_token(self) -> float:
        """Tokens a generated token attends to, averaged over the generated tokens."""
        return self.prompt + self.mean_square / (2 * self.mean)


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work on one GPU, for this model (see GPU for the hardware)."""

    step_s: float  # a decoding step: the weights read once
    row_s: float  # each row of a decoding batch
    ctx_s: float  # each context token a row attends to
    prefill_token_s: float
    train_token_s: float  # forward, backward and the old log-probs of one trained token

    @classmethod
    def of(cls, d: ModelDims, rollout_dtype: str, gradient_checkpointing: bool, *, train_seq_len: float,
           gpu: GPU = H100, kv_bytes: int | None = None, lora: bool = False) -> Rates:
        """`train_seq_len`: a trained sequence's tokens (its attention's FLOP grow with it).
        `kv_bytes`: of one cached K or V element (1 for an FP8 cache); default rollout_dtype's.
        `lora`: trainer.lora with SGLang rollouts: backward skips the frozen base's weight gradients,
        and decoding, through the unmerged adapter, takes LORA_DECODE_SLOWDOWN times as long."""
        n = d.params()
        b = BYTES[rollout_dtype]
        kv = b if kv_bytes is None else kv_bytes
        # torchtitan's forward and backward (6 of the passes' FLOP), 2 more recomputing the old log-probs,
        # 2 more recomputing the forward under gradient checkpointing; under LoRA backward computes the
        # activations' gradients but not the frozen weights' (2N less; the adapter's own ~6 x its
        # parameters, left out)
        passes = 10 if gradient_checkpointing else 8
        train_flop = passes / 6 * token_flops(d, train_seq_len) - (2 * n if lora else 0)
        decode = LORA_DECODE_SLOWDOWN if lora else 1.0  # every decoding term: the measurements are whole runs
        hbm, flop = gpu.decode_share * gpu.hbm_bytes_s, gpu.decode_share * gpu.bf16_flop_s
        return cls(step_s=decode * (b * n / hbm + gpu.decode_overhead_s),
                   row_s=decode * 2 * n / flop,
                   ctx_s=decode * d.kv_bytes_per_token(kv) / hbm,
                   prefill_token_s=2 * n / flop,
                   train_token_s=train_flop / (gpu.train_share * gpu.bf16_flop_s))


def tp_efficiency(tp: int) -> float:
    """Share of tp GPUs' speed one tensor-parallel engine keeps: 0.9 per doubling (an assumption:
    its all-reduces per layer)."""
    return 0.9 ** math.log2(tp)


@dataclass(frozen=True)
class Rollout:
    seconds: float
    trained_tokens: float
    rows_at_once: int  # concurrent rows per engine


def rollout_step(rates: Rates, lengths: Lengths, *, engines: int, tp: int, kv_tokens: int, rollouts: int,
                 max_concurrency: int, c3po_budget: int | None = None, c3po_pool: int = 0) -> Rollout:
    """One step's rollout on `engines` engines of tp GPUs each, with a KV cache of kv_tokens each.

    Synchronous: every engine decodes its share of the batch until the longest is done; its rows
    decode together as far as the KV cache holds them at their average size (prompt + half the
    response), so the decoding steps are the longest response or the share's tokens over the rows
    that fit, whichever is more. C3PO++: the step ends when the budget's tokens are generated, the
    engines kept full by the pool, and the rollouts resumed next step are prefilled again."""
    speed = tp * tp_efficiency(tp)
    occupancy = lengths.prompt + lengths.mean / 2
    fit = max(1, int(kv_tokens // occupancy))
    if c3po_budget is None:
        share = math.ceil(rollouts / engines)
        rows = min(share, fit, max_concurrency)
        generated = share * lengths.mean
        steps = max(lengths.longest_of(share), generated / rows)
        contexts = share * (lengths.prompt * lengths.mean + lengths.mean_square / 2)
        prefill = share * lengths.prompt
        trained = rollouts * lengths.mean
    else:
        rows = min(math.ceil(c3po_pool / engines), fit, max_concurrency)
        generated = c3po_budget / engines
        steps = generated / rows
        contexts = generated * lengths.context_per_token
        prefill = rows * lengths.context_per_token  # the pool's rollouts, prefilled again under new weights
        trained = float(c3po_budget)
    seconds = (rates.step_s * steps + rates.row_s * generated + rates.ctx_s * contexts
               + rates.prefill_token_s * prefill) / speed
    return Rollout(seconds, trained, rows)


@dataclass(frozen=True)
class Training:
    seconds: float
    microbatches: int  # per rank per PPO minibatch: the gradient accumulation
    parts: dict[str, float]


def training_step(rates: Rates, d: ModelDims, *, trained_tokens: float, ranks: int, nodes: int, dtype: str,
                  zero_stage: int, offload_optimizer: bool, offload_params: bool, microbatch_tokens: int,
                  chunk_tokens: int, minibatches: int, gpu: GPU = H100, trained_params: int | None = None) -> Training:
    """One step's training on `ranks` data-parallel ranks over `nodes` nodes, and the weight push.

    Compute is the FLOP count at the assumed MFU, linear in ranks. On top, ZeRO's collectives, each
    moving the model's bytes once, at NVLink inside a node and the network across nodes, counted
    as if none overlapped compute: every micro-batch reduces its gradients (ZeRO-3 also gathers
    the parameters for its forward and again for its backward), every PPO minibatch's step
    gathers the updated parameters (ZeRO-1/2); CPU offload (the optimizer step on the host and the gradients and
    parameters over PCIe each minibatch; offloaded parameters cross PCIe in every micro-batch);
    one overhead per log-prob chunk; the optimizer step's fixed cost and the push. Under LoRA
    (`trained_params`: the adapter's) the gradients reduced, the optimizer offloaded and the push are
    the adapter's; ZeRO-3 still gathers the whole (frozen) parameters."""
    n, b = d.params(), BYTES[dtype]
    t = n if trained_params is None else trained_params
    per_rank = trained_tokens / ranks
    micro_total = math.ceil(per_rank / (PACKING_FILL * microbatch_tokens))
    micro_per_minibatch = math.ceil(micro_total / minibatches)
    link = gpu.nvlink_bytes_s if nodes == 1 else gpu.network_bytes_s
    unit = (b * n / link) if ranks > 1 else 0.0
    per_micro, per_minibatch = (3, 0) if zero_stage >= 3 else (1, 1)
    if trained_params is None:
        collectives = unit * (per_micro * micro_total + per_minibatch * minibatches)
    else:  # the adapter's gradients reduced (and gathered after a ZeRO-1/2 step); ZeRO-3's gathers whole
        grads = unit * t / n
        collectives = (grads + (per_micro - 1) * unit) * micro_total + per_minibatch * minibatches * grads
    parts = {"compute": rates.train_token_s * per_rank,
             "log-prob chunks": CHUNK_OVERHEAD_S * per_rank / chunk_tokens,
             "ZeRO collectives": collectives,
             "step and push": STEP_OVERHEAD_S + b * t / gpu.weight_push_bytes_s}
    if offload_optimizer:
        parts["optimizer offload"] = minibatches * (t / nodes / gpu.cpu_adam_params_s
                                                    + 2 * b * t / ranks / gpu.pcie_bytes_s)
    if offload_params:
        parts["parameter offload"] = micro_total * 2 * b * n / gpu.pcie_bytes_s
    return Training(sum(parts.values()), micro_per_minibatch, parts)


def weight_load_s(d: ModelDims, rollout_dtype: str, gpu: GPU = H100, params: int | None = None) -> float:
    """The rollout side's pause to load pushed weights (asynchronous layouts); `params`: what is pushed
    (the adapter's under LoRA), the whole model by default."""
    return BYTES[rollout_dtype] * (d.params() if params is None else params) / gpu.weight_push_bytes_s
