"""The typed recipe schema: the single source of truth for every setting of every stage.

A recipe is a YAML file whose top-level keys are the sections below. Loading resolves
`--set a.b.c=value` overrides, validates types, rejects unknown keys, and computes a
sha256 over the canonical resolved form so that every reported number can be pinned to
exactly the configuration that produced it.

It is one file on purpose (over 500 lines): every section and its cross-field checks live where
a reader of a recipe looks them up, and the sha256 covers exactly what is defined here.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlrecipe.errors import UserError


class RecipeError(UserError):
    """A user mistake in a recipe: printed as one line, exit code 2."""


def _is_number_field(annotation: Any) -> bool:
    args = set(get_args(annotation)) or {annotation}
    return bool(args & {int, float}) and bool not in args


# No count, size or step in a recipe comes near this; a bigger integer is a typo (`rl.steps: 1e30`
# read as a number) that would only fail, or silently overflow, deep inside a stage.
MAX_INT = 2**31 - 1


def _too_big(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > MAX_INT
    if isinstance(value, (list, tuple)):
        return any(_too_big(v) for v in value)
    if isinstance(value, dict):
        return any(_too_big(v) for v in value.values())
    return False


# A field added to the schema after recipes were published enters the sha256 only when set to
# something other than its default: the recipes that never set it keep their sha256.
HASHED_WHEN_SET = {"hashed_when_set": True}


class Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `reward_correct: .nan` in any float field is refused here,
    # not found as NaN weights after a run that exited 0
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field; `rl.steps: true` is a typo, not one step
        if isinstance(value, bool) and _is_number_field(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not true/false")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_ints(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name != "seed" and _too_big(value):
            raise ValueError(f"integers in a recipe are at most {MAX_INT} (2**31 - 1)")
        return value


class TinyModel(Section):
    """A Qwen2-architecture model built from scratch with a local character tokenizer."""

    hidden_size: int = Field(128, ge=1)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(384, ge=1)
    max_position_embeddings: int = Field(512, ge=2)
    tie_word_embeddings: bool = True
    # Embedding rows beyond the tokenizer's (null: exactly the tokenizer's), as Qwen pads 151,665
    # tokens to 152,064: lets the CPU path run at the real vocabulary's memory footprint.
    vocab_size: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class ModelSection(Section):
    # An HF directory or hub id; or null with `tiny` set to build a model from scratch.
    path: str | None = None
    # The hub commit of `path` (40 hex digits): weights, tokenizer and chat template are fetched
    # at exactly this snapshot. null = whatever the hub serves today (recorded in env.json).
    revision: str | None = None
    tiny: TinyModel | None = None
    # Compute dtype of the trainer's master weights.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-f]{40}", value):
            raise ValueError("must be a full commit sha (40 lowercase hex digits); a branch or tag can move")
        return value

    @model_validator(mode="after")
    def _revision_needs_path(self) -> ModelSection:
        if self.revision is not None and self.path is None:
            raise ValueError("revision pins a hub snapshot of model.path; set model.path too")
        return self


PromptTemplate = Literal["r1", "plain", "raw", "areal_boba"]


class DataSection(Section):
    # Canonical JSONL files (see rlrecipe.data) or registry names (`boba-106k`).
    train: str | None = None
    # How a training prompt becomes token ids (rlrecipe/data/templates.py): r1 / plain through the
    # tokenizer's chat template; raw = the source file's prompt verbatim (boba data carries the
    # R1 template already); areal_boba = AReaL's evaluation prompt text.
    prompt_template: PromptTemplate = "r1"
    # The same for evaluation problems; null = prompt_template.
    eval_template: PromptTemplate | None = None
    max_prompt_tokens: int = Field(2048, gt=0)
    shuffle: bool = True

    @model_validator(mode="after")
    def _eval_template(self) -> DataSection:
        if self.eval_prompt_template == "raw":
            # eval sets hold bare problems: "raw" would feed them with no template at all
            raise ValueError("eval_template: evaluation problems carry no chat template, so 'raw' cannot "
                             "format them; set data.eval_template (areal_boba or r1)")
        return self

    @property
    def eval_prompt_template(self) -> str:
        return self.eval_template or self.prompt_template


class SFTSection(Section):
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(64, ge=1, description="sequences per optimizer step")
    max_length: int = Field(32768, gt=0)
    eval_every: int = Field(0, ge=0, description="steps; 0 = only at the end")
    save_every: int = Field(50, ge=1)


class IcePop(Section):
    # icepop: M(k) = k in [alpha, beta] else 0; tis: min(k, tis_cap); off: weight 1.
    mode: Literal["icepop", "tis", "off"] = "icepop"
    alpha: float = Field(0.5, gt=0)
    beta: float = Field(5.0, gt=0)
    tis_cap: float = Field(2.0, gt=0)

    @field_validator("mode", mode="before")
    @classmethod
    def _off_as_written(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _band(self) -> IcePop:
        if self.alpha >= self.beta:
            raise ValueError(f"alpha ({self.alpha}) must be below beta ({self.beta})")
        return self


class C3PO(Section):
    """C3PO++ budget-controlled partial rollout."""

    enabled: bool = True
    token_budget: int = Field(16384, gt=0, description="Phi: finished tokens that end a rollout phase")
    pool_capacity: int = Field(512, gt=0, description="Omega: trajectories in flight")
    max_staleness: int = Field(2, ge=0, description="sigma: steps an unfinished rollout may age")
    # per_call: the pool is topped up to Omega before each generate call, so within a step the
    # engine's batch shrinks as rollouts finish. continuous: a finished rollout's slot is handed
    # back at once and a new group starts as soon as samples_per_prompt slots are free, so the
    # engine keeps Omega rollouts running until the budget is reached.
    refill: Literal["per_call", "continuous"] = Field(
        "per_call", description="when new prompts enter the pool: before each generate call, or as rollouts finish")
    # Rollouts that end on the decoding step that reaches the budget all finish together (a cohort
    # started together and truncated at max_new_tokens can be thousands of tokens). carry: the
    # step trains the oldest finished rollouts until Phi is reached, and the rest wait, finished,
    # to train first next step; train: every rollout finished by then trains now (over budget).
    surplus: Literal["carry", "train"] = Field(
        "carry", description="finished rollouts past the budget: train them next step, or this step")


class Cov(Section):
    """Clip-Cov / KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617, Sec. 4.3, Eq. 11-13): tokens whose covariance
    cov = (logp - mean logp)(A - mean A) is high drive entropy down; hold them back."""

    mode: Literal["off", "clip_cov", "kl_cov"] = "off"
    # Clip-Cov: detach the gradient of clip_fraction x N tokens drawn at random among those with
    # cov in [clip_low, clip_high] (the paper's r = 2e-4, omega = [1, 5]).
    clip_fraction: float = Field(2e-4, gt=0, le=1)
    clip_low: float = 1.0
    clip_high: float = 5.0
    # KL-Cov: the top kl_fraction x N tokens by cov get + kl_coef * |logp - logp_old| (the authors'
    # k = 0.2%, beta = 1), ranked among the tokens in the loss that no clip holds, with the PPO clip
    # kept: a variant of the authors' code, which drops the clip (algo/cov.py says why).
    kl_fraction: float = Field(2e-3, gt=0, le=1)
    kl_coef: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _band(self) -> Cov:
        if self.clip_low >= self.clip_high:
            raise ValueError(f"clip_low ({self.clip_low}) must be below clip_high ({self.clip_high})")
        return self


class EntropyWatch(Section):
    """Alarms on the mean token entropy of each step's batch (null bounds: no alarm)."""

    low: float | None = Field(None, ge=0, description="collapse: entropy below this")
    high: float | None = Field(None, gt=0, description="explosion: entropy above this")
    patience: int = Field(5, ge=1, description="consecutive steps out of bounds before an alarm")

    @model_validator(mode="after")
    def _bounds(self) -> EntropyWatch:
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class RLSection(Section):
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(512, ge=1)
    samples_per_prompt: int = Field(16, ge=1)
    ppo_minibatches: int = Field(4, ge=1)
    eps_clip_low: float = Field(0.2, ge=0)
    eps_clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    adv_norm: Literal["global", "group", "none"] = "global"
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    reward_correct: float = 5.0
    reward_wrong: float = -5.0
    # KL to a frozen copy of the initial policy, added to the loss with this coefficient (0: no
    # reference model is loaded, as AReaL-boba). Estimators of KL(pi_theta || pi_ref) per token
    # (Schulman, "Approximating KL divergence", 2020): k1 = log(pi/pi_ref), k2 = (log(pi/pi_ref))^2 / 2,
    # k3 = pi_ref/pi - 1 - log(pi_ref/pi); k3_unbiased = k3 times pi_theta/pi_old (DeepSeek-V3.2).
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "k3_unbiased"] = "k3"
    # token: PPO's per-token ratio. sequence: GSPO (Zheng et al. 2025, arXiv:2507.18071, Eq. 5-7),
    # s_i = exp(mean_t(logp - logp_old)) clipped to [1 - gspo_eps_low, 1 + gspo_eps_high] per
    # sequence (the paper's 3e-4 / 4e-4); needs loss_agg: seq_mean_token_mean, GSPO's average.
    ratio_level: Literal["token", "sequence"] = "token"
    gspo_eps_low: float = Field(3e-4, ge=0)
    gspo_eps_high: float = Field(4e-4, ge=0)
    cov: Cov = Cov()
    # loss -= entropy_coef x entropy of the tokens in the loss, aggregated as the loss is. 0 = off.
    entropy_coef: float = Field(0.0, ge=0)
    entropy_watch: EntropyWatch = EntropyWatch()
    # Negative advantages are multiplied by this after normalisation: 1 = off, 0 = learn from
    # positive samples only (the seeds' "+1/-1 to +1/0"; negative gradients as the cause of
    # collapse: LLDS, arXiv:2512.04220).
    negative_adv_scale: float = Field(1.0, ge=0, le=1)
    icepop: IcePop = IcePop()
    # DeepSeek-V3.2 off-policy sequence mask: drop negative-advantage sequences whose mean
    # log(pi_infer / pi_theta) exceeds delta, pi_theta the policy being updated (each PPO
    # minibatch decides again). null = off.
    offpolicy_seq_delta: float | None = None
    # AReaL's early_stop_imp_ratio: a micro-batch whose mean importance ratio pi_theta/pi_old
    # exceeds this contributes no gradient. null = off.
    early_stop_imp_ratio: float | None = Field(None, gt=1)
    c3po: C3PO = C3PO()
    # Asynchronous RL: rollout for later steps runs while this step trains. The batch trained at step
    # s is collected under the weights of step s - async_lag (the first async_lag steps' under the
    # starting weights), so which weights produced each token follows from the schedule, not from
    # timing. 0 = synchronous. AReaL calls the bound max_head_offpolicyness.
    async_lag: int = Field(0, ge=0, le=64, json_schema_extra=HASHED_WHEN_SET)
    eval_every: int = Field(0, ge=0)
    save_every: int = Field(10, ge=1)
    max_bad_steps: int = Field(3, ge=1, description="consecutive NaN/inf steps before stopping")

    @model_validator(mode="after")
    def _gspo_averages_sequences(self) -> RLSection:
        if self.ratio_level == "sequence" and self.loss_agg != "seq_mean_token_mean":
            raise ValueError("ratio_level: sequence (GSPO) averages the loss over sequences; "
                             "set loss_agg: seq_mean_token_mean")
        return self


class SGLangServer(Section):
    tp_size: int = Field(1, ge=1)
    # SGLang's data parallelism inside one server (--dp-size): dp_size model copies behind one URL.
    # A launched server takes tp_size x dp_size GPUs; the servers of one node share its GPUs.
    dp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    host: str = "127.0.0.1"
    base_port: int = Field(30000, gt=0, lt=65536)
    num_servers: int = Field(1, ge=1)
    # Nodes the num_servers servers are spread over, num_servers / nodes on each. 1: the run
    # launches them all on rank 0's node. More: each node starts its share with
    # `rlrecipe rollout-servers RECIPE --node N`, and the run attaches to them with rollout.urls.
    nodes: int = Field(1, ge=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = []
    # Concurrent /generate requests the engine keeps open per server (SGLang batches them itself).
    max_concurrency: int = Field(512, ge=1)
    # How long a /generate may go without an answer before its server counts as hung: this floor
    # plus an allowance per requested new token (0.05 s: 27,648 tokens -> 23 min on top).
    request_timeout_s: float = Field(300.0, gt=0)
    request_timeout_per_token_s: float = Field(0.05, ge=0)
    # A server that dies or hangs mid-step: false = stop with an error naming it; true = send its
    # requests to the other servers and leave it out from then on (the run goes on while one lives).
    retry_on_other_servers: bool = False
    # A launched server (the run's own, or one `rlrecipe rollout-servers` started) that exits, or
    # (the run's) stops answering, is started again, at most this many times each; a server left
    # out that answers again, launched or attached, is taken back at the next weight update, which
    # brings it the current weights (rollout/server_recovery.py). Needs retry_on_other_servers.
    max_restarts: int = Field(0, ge=0)
    # Replaces `python -m sglang.launch_server ...` (then tp/dp/mem/extra_args are not added).
    # Placeholders: {model} {host} {port} {index} {dtype} {seed} {base_gpu_id} {revision} (model.revision for a
    # hub id started by `rlrecipe rollout-servers`, else empty). E.g. the CPU stand-in that
    # speaks the same API: ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}"].
    launch_cmd: list[str] = []
    # After each step: "disk" = HF export + /update_weights_from_disk (always works); "distributed"
    # = the trainer broadcasts the tensors into the servers (/update_weights_from_distributed),
    # nothing written to disk. weight_sync_address must be the trainer's address as the servers see it.
    weight_sync: Literal["disk", "distributed"] = "disk"
    weight_sync_backend: Literal["nccl", "gloo"] = "nccl"
    weight_sync_address: str = "127.0.0.1"
    weight_sync_port: int = Field(29650, gt=0, lt=65536)
    weight_sync_bucket_mb: int = Field(512, ge=1, description="tensors per update request, at most this size")
    # sglang-router in front of the servers (launched or rollout.urls), on host:router_port: every
    # /generate goes to it and it balances them (router_policy); weight updates, aborts and server
    # info still go to each server.
    router: bool = False
    router_port: int = Field(31000, gt=0, lt=65536)
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    router_extra_args: list[str] = []
    # Replaces `python -m sglang_router.launch_router ...` (e.g. a router installed in its own
    # environment). Placeholders: {host} {port} {policy}; an argument "{worker_urls}" becomes one
    # argument per server URL.
    router_launch_cmd: list[str] = []

    @model_validator(mode="after")
    def _router_retries_itself(self) -> SGLangServer:
        if self.router and self.retry_on_other_servers:
            raise ValueError("retry_on_other_servers and router exclude each other: behind the router, "
                             "requests are spread and retried across the servers by the router itself")
        if self.max_restarts and not self.retry_on_other_servers:
            raise ValueError("max_restarts needs retry_on_other_servers: without it a run stops at a server's "
                             "first failure, before a restarted one could be taken back")
        return self

    @model_validator(mode="after")
    def _servers_split_over_nodes(self) -> SGLangServer:
        if self.num_servers % self.nodes:
            raise ValueError(f"num_servers {self.num_servers} does not split evenly over nodes {self.nodes}: "
                             "every rollout node starts num_servers / nodes servers; make num_servers a "
                             "multiple of nodes")
        return self

    @model_validator(mode="after")
    def _broadcast_needs_dp_1(self) -> SGLangServer:
        # SGLang's /init_weights_update_group and /update_weights_from_distributed assert dp_size == 1
        # (newer releases also take --enable-dp-attention, whose dp ranks sit inside tp_size GPUs:
        # not the tp_size x dp_size copies dp_size places here). Refused here, not after a step.
        if self.weight_sync == "distributed" and self.dp_size > 1:
            raise ValueError(f"weight_sync: distributed with dp_size {self.dp_size}: SGLang joins a server to "
                             "the weight broadcast group only with dp_size 1; set dp_size: 1 and run "
                             "num_servers x dp_size servers instead, or weight_sync: disk")
        return self


class RolloutSection(Section):
    engine: Literal["inprocess", "sglang"] = "inprocess"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(27648, gt=0)
    max_batch: int = Field(512, ge=1, description="in-process engine: decoding slots")
    refill_fraction: float = Field(0.25, gt=0, le=1, description="refill when this share of slots is free")
    # The rollout engine receives the trainer's weights only after every L-th step (1: after each),
    # the off-policy lag of asynchronous RL: rollouts then come from a policy up to L - 1 updates old.
    weight_update_every: int = Field(1, ge=1)
    # STRESS TEST, not a model of any engine: Gaussian noise of this standard deviation added to
    # the in-process engine's logits before RL sampling, whose recorded log-probs are those of the
    # perturbed distribution: a dial for the train/inference mismatch (evaluation never adds it).
    stress_logit_noise: float = Field(0.0, ge=0)
    # Attach to running servers instead of launching them.
    urls: list[str] = []
    sglang: SGLangServer = SGLangServer()


class TrainerSection(Section):
    engine: Literal["torch", "deepspeed"] = "torch"
    lr: float = Field(1e-5, gt=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    max_tokens_per_microbatch: int = Field(30720, gt=0)
    # Tokens whose logits exist at once when computing log-probs and entropies: memory is
    # O(chunk x vocab), not O(micro-batch x vocab). Does not change the numbers.
    logprob_chunk_tokens: int = Field(1024, gt=0)
    # Memory of one GPU (training and rollout GPUs alike): `rlrecipe plan` checks the recipe against it.
    gpu_memory_gib: float = Field(80.0, gt=0)
    bf16_autocast: bool = False
    # Torch engine: forward in float16 autocast over float32 weights, with dynamic loss scaling
    # (train/loss_scale.py). DeepSpeed: use model.dtype: float16 (its own loss scaler).
    fp16_autocast: bool = False
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    nproc: int = Field(1, ge=1, description="training processes per node")
    nodes: int = Field(1, ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29500, gt=0, lt=65536)


    @model_validator(mode="after")
    def _one_autocast(self) -> TrainerSection:
        if self.fp16_autocast and self.bf16_autocast:
            raise ValueError("fp16_autocast and bf16_autocast: choose one")
        if self.fp16_autocast and self.engine == "deepspeed":
            raise ValueError("fp16_autocast is the torch engine's; with deepspeed set model.dtype: float16 "
                             "(DeepSpeed's fp16 with its loss scaler)")
        return self


class Benchmark(Section):
    name: str
    # Canonical eval JSONL (id, problem, answer) or a registry name (`aime24`).
    path: str
    reference: dict[str, float] = {}


class EvalSection(Section):
    benchmarks: list[Benchmark] = []
    n_samples: int = Field(32, ge=1)
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(32768, gt=0)
    pass_k: list[Annotated[int, Field(ge=1)]] = [1, 8, 16]
    greedy: bool = False
    max_problems: int | None = Field(None, ge=1)
    # Samples handed to the rollout engine at once. Each wave is graded and appended to
    # samples.jsonl before the next starts, so a killed eval loses at most one wave; keep it a few
    # times the engine's concurrency so no wave waits long on its slowest sample alone.
    wave_size: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _pass_k_within_samples(self) -> EvalSection:
        # pass@k needs k samples: a k set above n_samples would be dropped from the report. The
        # default list is kept as is (its k above n_samples are simply not reported).
        if "pass_k" in self.model_fields_set and self.pass_k and max(self.pass_k) > self.n_samples:
            raise ValueError(f"pass_k {max(self.pass_k)} is above n_samples ({self.n_samples}): pass@k needs "
                             "k samples per problem")
        return self


class Tracking(Section):
    wandb: bool = False
    project: str = "rlrecipe"
    mode: Literal["offline", "online"] = "offline"


class RunSection(Section):
    name: str
    output_dir: str = "runs"
    # what every random generator the run seeds accepts (numpy's limit)
    seed: int = Field(1, ge=0, le=2**32 - 1)
    # Where this stage starts from: a path, or `run:<name>` for another run's final export.
    init_from: str | None = None
    keep_checkpoints: int = Field(2, ge=1)
    tracking: Tracking = Tracking()

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        # The run directory is output_dir/name, cleared and overwritten: a name that climbs out of
        # output_dir or nests into another run would reach someone else's files.
        if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError("must be one non-empty directory name (no '/', '\\', '.' or '..')")
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError("must not contain control characters (tabs, newlines, escapes)")
        if len(name.encode("utf-8")) > 200:  # a directory name is at most 255 bytes; suffixes are added
            raise ValueError(f"is {len(name.encode('utf-8'))} bytes long; a run name is at most 200")
        return name

    @property
    def dir(self) -> Path:
        """This run's directory: records, checkpoints, `final/`, `eval/`."""
        return Path(self.output_dir) / self.name


def _digest(data: dict) -> str:
    """sha256 of the canonical JSON form (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _drop_unset_additions(section: BaseModel, dumped: dict) -> dict:
    """`dumped` without the fields marked HASHED_WHEN_SET that hold their default, in every section."""
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if field.json_schema_extra == HASHED_WHEN_SET and value == field.default:
            dumped.pop(name, None)
        elif isinstance(value, BaseModel) and isinstance(dumped.get(name), dict):
            _drop_unset_additions(value, dumped[name])
    return dumped


class Recipe(Section):
    run: RunSection
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    eval: EvalSection = EvalSection()

    @model_validator(mode="after")
    def _lag_resumes_exactly(self) -> Recipe:
        # a checkpoint restores the trainer's weights; the engine's older ones are not stored, so
        # every checkpoint must fall on a step after which the engine got the trainer's weights
        every = self.rollout.weight_update_every
        if every > 1 and self.rl.save_every % every:
            raise ValueError(f"rl.save_every ({self.rl.save_every}) must be a multiple of "
                             f"rollout.weight_update_every ({every}) so that a resumed run is the same run")
        return self

    @model_validator(mode="after")
    def _async_schedule(self) -> Recipe:
        lag = self.rl.async_lag
        if lag and self.rollout.weight_update_every > 1:
            raise ValueError("rl.async_lag and rollout.weight_update_every > 1 both delay the rollout's weights; "
                             "set one of them")
        if lag > 1 and self.rollout.engine == "sglang" and self.rollout.sglang.weight_sync == "distributed":
            raise ValueError("rl.async_lag > 1 with rollout.sglang.weight_sync: distributed would broadcast weights "
                             "into servers that are generating; use weight_sync: disk or async_lag: 1")
        return self

    @model_validator(mode="after")
    def _noise_needs_inprocess(self) -> Recipe:
        if self.rollout.stress_logit_noise > 0 and self.rollout.engine != "inprocess":
            raise ValueError("rollout.stress_logit_noise is a stress test of the in-process engine; "
                             "set it to 0 with rollout.engine: sglang")
        return self

    @model_validator(mode="after")
    def _model_source(self) -> Recipe:
        if self.model.path is None and self.model.tiny is None and self.run.init_from is None:
            raise ValueError("model: set model.path (HF dir or hub id), model.tiny (build from scratch), "
                             "or run.init_from (another run's output)")
        return self

    def hashed(self) -> dict:
        """What the sha256 covers: every field, defaults included, but a field added with
        HASHED_WHEN_SET only once set (so recipes written before it keep their sha256)."""
        return _drop_unset_additions(self, self.model_dump(mode="json"))

    def sha256(self) -> str:
        return _digest(self.hashed())

    def experiment_sha256(self) -> str:
        """The sha256 without run.seed, run.name and run.output_dir: runs that differ only there
        are one experiment under several seeds (RESULTS.md shows their spread)."""
        d = self.hashed()
        for key in ("seed", "name", "output_dir"):
            d["run"].pop(key, None)
        return _digest(d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class LoadedRecipe(BaseModel):
    """A validated recipe with where it came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    recipe: Recipe
    path: str
    overrides: list[str] = []

    @property
    def sha256(self) -> str:
        return self.recipe.sha256()


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. rl.steps=10")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise RecipeError(f"--set {item!r}: empty key")
    # YAML scalars give ints, floats, bools, null and lists their natural types.
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):  # RecursionError: nested too deeply to be a value
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        keys, value = _parse_override(item)
        if _takes_text(keys) and not isinstance(value, str):
            # a text field takes the text as written: YAML would read `off` as false, `2024` as a number
            value = item.split("=", 1)[1].strip()
        node = data
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"--set {item!r}: {'.'.join(keys[:-1])} is not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def _section_at(loc) -> type[BaseModel] | None:
    """The schema section that holds the key at the end of `loc` (list indices skipped), or None."""
    model: Any = Recipe
    for part in list(loc)[:-1]:
        if isinstance(part, int) or str(part).isdigit():
            continue  # an item of a list: its model is the list's item type, found below
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        candidates = [field.annotation, *get_args(field.annotation)]
        candidates += [a for c in candidates for a in get_args(c)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _takes_text(keys: list[str]) -> bool:
    """Whether the field at `keys` holds text only (a str, or a choice of strings)."""
    section = _section_at(keys)
    field = getattr(section, "model_fields", {}).get(keys[-1]) if section else None
    if field is None:
        return False
    kinds = [a for a in (field.annotation, *get_args(field.annotation)) if a is not type(None)]
    flat = [k for a in kinds for k in (get_args(a) if get_origin(a) is Literal else (a,))]
    return bool(flat) and all(k is str or isinstance(k, str) for k in flat if k is not type(None))


def _did_you_mean(loc: tuple) -> str:
    """'; did you mean X?' for an unknown key close to a field of the section it was given in."""
    import difflib

    section = _section_at(loc)
    fields = list(getattr(section, "model_fields", {})) if section else []
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _format_validation_error(path: str, err: ValidationError) -> str:
    errors = err.errors()
    # a misspelt key also leaves its field "missing": the unknown key, with a guess, says more
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key" + _did_you_mean(first["loc"])
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    got = first.get("input")
    shown = "" if first["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
    if len(shown) > 100:  # a 100,000-character value is not echoed whole
        shown = shown[:90] + "...)"
    return f"{path}: {loc}: {msg}{shown}{more}"


def recipe_from_dict(data: dict, path: str = "<dict>") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(path, err)) from None


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the later one, so a
    second `rl:` section would silently replace the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`, then overridden: intended
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class refuses it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path):
    try:
        return yaml.load(path.read_bytes().decode("utf-8"), Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not valid UTF-8 (byte {err.start})") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply to be a recipe") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}:{where} invalid YAML: {getattr(err, 'problem', err)}") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> LoadedRecipe:
    path = Path(path)
    overrides = list(overrides or [])
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    data = apply_overrides(data, overrides)
    recipe = recipe_from_dict(data, str(path))
    _check_files(recipe, path)
    return LoadedRecipe(recipe=recipe, path=str(path), overrides=overrides)


def _looks_like_file(value: str) -> bool:
    return "/" in value or value.endswith((".jsonl", ".json"))


def _check_files(recipe: Recipe, path: Path) -> None:
    """Local files a recipe names must exist, unless an earlier stage of the chain makes them."""
    # data sits below recipe and never imports it (tests/test_import_layers.py); imported here only
    # because this check alone needs the registry
    from rlrecipe.data.registry import is_registered

    candidates: list[tuple[str, str | None]] = [("data.train", recipe.data.train)]
    candidates += [(f"eval.benchmarks.{i}.path", b.path) for i, b in enumerate(recipe.eval.benchmarks)]
    for field, value in candidates:
        if value is None or is_registered(value) or not _looks_like_file(value):
            continue
        if value.startswith("data/") or Path(value).exists():
            # data/ is where `rlrecipe data` writes: a file there may not exist yet.
            continue
        raise RecipeError(f"{path}: {field}: file not found: {value}")
