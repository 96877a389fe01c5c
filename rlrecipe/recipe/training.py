"""Recipe sections for what is trained and how: the model, the data, SFT, and RL's algorithm.

Each section holds its fields and the cross-field checks a reader of a recipe looks up beside them;
`rlrecipe.recipe.schema` assembles them into `Recipe`, whose sha256 covers every field defined here.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlrecipe.recipe.base import HASHED_WHEN_SET, Section


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
    # icepop: M(k) = k in [alpha, beta] else 0; tis: min(k, tis_cap); off: weight 1;
    # m2po: k, with the batch's largest (log k)^2 trust-region tokens masked until the mean of the
    # rest is at most m2_threshold (Zheng et al. 2025; algo/m2po.py).
    mode: Literal["icepop", "tis", "m2po", "off"] = "icepop"
    alpha: float = Field(0.5, gt=0)
    beta: float = Field(5.0, gt=0)
    tis_cap: float = Field(2.0, gt=0)
    m2_threshold: float = Field(0.04, gt=0, json_schema_extra=HASHED_WHEN_SET)

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


class DynamicSampling(Section):
    """DAPO's dynamic sampling (arXiv:2503.14476, Sec. 3.2): a group whose samples are all right or
    all wrong leaves the batch, and more prompts are sampled to take its place. Under C3PO++ a
    finished rollout waits in the pool until its whole group has finished; only groups with
    signal count toward the token budget (docs/design.md)."""

    enabled: bool = False
    # Extra prompts a step may draw to replace dropped groups (null: rl.prompts_per_step); once
    # reached, the step's further groups without signal train as without dynamic sampling.
    max_extra_prompts: int | None = Field(None, ge=0)


class Overlong(Section):
    """DAPO's overlong handling (arXiv:2503.14476, Sec. 3.4). Only truncation at
    rollout.max_new_tokens counts: a rollout C3PO++'s budget cut is resumed, not truncated."""

    # Overlong filtering: a truncated response's tokens leave the loss (weight 0; they keep their
    # place in the loss normaliser, as IcePop's masked tokens do).
    filter: bool = False
    # Soft overlong punishment: reward += penalty x R_length, over the last `cache` tokens before
    # rollout.max_new_tokens (0 = off); R_length falls linearly from 0 to -1 (the paper's 1 is
    # against rewards of +-1).
    cache: int = Field(0, ge=0)
    penalty: float = Field(1.0, ge=0)


class RLSection(Section):
    steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(512, ge=1)
    samples_per_prompt: int = Field(16, ge=1)
    ppo_minibatches: int = Field(4, ge=1)
    eps_clip_low: float = Field(0.2, ge=0)
    eps_clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    # global / group / none; group_mean: Dr. GRPO (no std); group_quantile: QAE's K-quantile
    # baseline, K = adv_quantile (algo/advantages.py)
    adv_norm: Literal["global", "group", "group_mean", "group_quantile", "none"] = "global"
    adv_quantile: float = Field(0.4, gt=0, lt=1, json_schema_extra=HASHED_WHEN_SET)
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
    # AReaL's early_stop_imp_ratio: a PPO minibatch whose mean importance ratio pi_theta/pi_old
    # exceeds this contributes no gradient (decided over the whole minibatch). null = off.
    early_stop_imp_ratio: float | None = Field(None, gt=1)
    c3po: C3PO = C3PO()
    dynamic_sampling: DynamicSampling = Field(DynamicSampling(), json_schema_extra=HASHED_WHEN_SET)
    overlong: Overlong = Field(Overlong(), json_schema_extra=HASHED_WHEN_SET)
    # Asynchronous RL: rollout for later steps runs while this step trains. The batch trained at step
    # s is collected under the weights of step s - async_lag (the first async_lag steps' under the
    # starting weights), so which weights produced each token follows from the schedule, not from
    # timing. 0 = synchronous. AReaL calls the bound max_head_offpolicyness.
    async_lag: int = Field(0, ge=0, le=64, json_schema_extra=HASHED_WHEN_SET)
    # eta (AReaL's bound on off-policyness): the most versions a trained token may lag the policy that
    # trains on it. A batch collected async_lag steps ahead is that many versions old, and C3PO++'s
    # resumed rollouts add the steps they waited (up to c3po.max_staleness), so L + sigma unbounded:
    # with eta set the pool drops a rollout once its oldest token would train more than eta behind.
    max_token_staleness: int | None = Field(None, ge=0, json_schema_extra=HASHED_WHEN_SET)
    eval_every: int = Field(0, ge=0)
    save_every: int = Field(10, ge=1)
    max_bad_steps: int = Field(3, ge=1, description="consecutive NaN/inf steps before stopping")

    @model_validator(mode="after")
    def _staleness_bound_holds_the_lag(self) -> RLSection:
        eta = self.max_token_staleness
        if eta is not None and eta < self.async_lag:
            raise ValueError(f"max_token_staleness {eta} is below async_lag {self.async_lag}: every token of a batch "
                             "collected async_lag steps ahead is that many versions old")
        return self

    @property
    def rollout_age_limit(self) -> int:
        """Steps a rollout may wait in the C3PO++ pool: sigma, or less where eta leaves less after the lag."""
        sigma = self.c3po.max_staleness
        eta = self.max_token_staleness
        return sigma if eta is None else min(sigma, eta - self.async_lag)

    @model_validator(mode="after")
    def _gspo_averages_sequences(self) -> RLSection:
        if self.ratio_level == "sequence" and self.loss_agg != "seq_mean_token_mean":
            raise ValueError("ratio_level: sequence (GSPO) averages the loss over sequences; "
                             "set loss_agg: seq_mean_token_mean")
        return self
