"""Recipe sections for where a run executes: rollout engine and SGLang servers, trainer, eval, run.

Each section holds its fields and the cross-field checks a reader of a recipe looks up beside them;
`rlrecipe.recipe.schema` assembles them into `Recipe`, whose sha256 covers every field defined here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rlrecipe.recipe.base import HASHED_WHEN_SET, Section

# Servers whose weights one push loads at once at most (the client's threads, rollout/sglang/weights.py);
# here, below both, so that fit's and the projection's push costs read the same number.
MAX_PARALLEL_LOADS = 32


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
    # brings it the current weights (rollout/sglang/recovery.py). Needs retry_on_other_servers.
    max_restarts: int = Field(0, ge=0)
    # Replaces `python -m sglang.launch_server ...` (then tp/dp/mem/extra_args are not added).
    # Placeholders: {model} {host} {port} {index} {dtype} {seed} {base_gpu_id} {kv_cache_dtype}
    # {lora_args} (under trainer.lora, SGLang's --enable-lora flags; one argument each, none without)
    # {revision} (model.revision for a hub id started by `rlrecipe rollout-servers`, else empty). E.g. the CPU stand-in that
    # speaks the same API: ["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}"].
    launch_cmd: list[str] = []
    # After each step: "disk" = HF export + /update_weights_from_disk (always works); "distributed"
    # = the trainer broadcasts the tensors into the servers (/update_weights_from_distributed),
    # nothing written to disk. weight_sync_address must be the trainer's address as the servers see it.
    # "tensor" = the tensors pickled into /update_weights_from_tensor requests, in buckets of
    # weight_sync_bucket_mb (rollout/sglang/tensor_push.py): no group to join, over HTTP alone.
    # "ipc" = the same requests carrying handles instead of bytes (CUDA IPC on GPUs, shared-memory
    # files on a CPU; rollout/weights/handles.py): every trainer rank shares its copy and each server
    # rank maps the one on its GPU. Servers on the trainer's machine only (launched, or local urls).
    weight_sync: Literal["disk", "distributed", "tensor", "ipc"] = "disk"
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
    # How a launched server (and router) proves it is the run's own before anything but its health
    # probe reaches it (rollout/sglang/ownership.py): "socket_and_key" = its process group holds the
    # port's listening socket, and its key proves it; "key" = its key alone, for a launch_cmd whose
    # server's socket another process holds (`docker run -p`: docker-proxy), which must pass
    # SGLANG_API_KEY on to the server; "off" = nothing is checked.
    ownership_proof: Literal["socket_and_key", "key", "off"] = Field("socket_and_key", json_schema_extra=HASHED_WHEN_SET)

    @model_validator(mode="after")
    def _restarts_need_retries(self) -> SGLangServer:
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
        # every data-parallel replica's rank j would read entry j of the handles: twice read, and from
        # another replica's GPU
        if self.weight_sync == "ipc" and self.dp_size > 1:
            raise ValueError(f"weight_sync: ipc with dp_size {self.dp_size}: each server rank must read the "
                             "handles of the trainer rank on its own GPU; run num_servers x dp_size servers of "
                             "dp_size 1 instead, or weight_sync: disk")
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
    # The rollout engine shares the trainer's GPUs: each step generates, then the engine releases its
    # KV cache and weights while the trainer trains, then takes the new weights back (rl/colocate.py).
    # false: rollout and training have GPUs of their own.
    colocate: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    # The KV cache's storage: "auto" = rollout.dtype; fp8_e4m3 / fp8_e5m2 = one byte an element with a
    # scale per layer for K and one for V (SGLang's --kv-cache-dtype, which this sets; docs/fp8-kv.md).
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field("auto", json_schema_extra=HASHED_WHEN_SET)
    # FP8 scales: "unit" = 1.0 (SGLang without calibration); "calibrated" = amax / fp8_max per layer,
    # recomputed from the current weights after every push (in-process engine only: SGLang cannot).
    kv_scales: Literal["unit", "calibrated"] = Field("unit", json_schema_extra=HASHED_WHEN_SET)
    # Attach to running servers instead of launching them.
    urls: list[str] = []
    sglang: SGLangServer = SGLangServer()

    @property
    def kv_cache_flag(self) -> str | None:
        """The value of --kv-cache-dtype in rollout.sglang.extra_args or launch_cmd, if any."""
        args = [*self.sglang.extra_args, *self.sglang.launch_cmd]
        for i, arg in enumerate(args):
            if arg.startswith("--kv-cache-dtype="):
                return arg.split("=", 1)[1]
            if arg == "--kv-cache-dtype" and i + 1 < len(args):
                return args[i + 1]
        return None

    @property
    def kv_storage(self) -> str:
        """The KV cache's dtype as served: kv_cache_dtype, else an FP8 --kv-cache-dtype flag, else auto."""
        flag = self.kv_cache_flag
        if self.kv_cache_dtype == "auto" and self.engine == "sglang" and flag in ("fp8_e4m3", "fp8_e5m2"):
            return flag
        return self.kv_cache_dtype

    @model_validator(mode="after")
    def _kv_cache_consistent(self) -> RolloutSection:
        flag = self.kv_cache_flag
        if self.kv_cache_dtype != "auto" and flag not in (None, "{kv_cache_dtype}", self.kv_cache_dtype):
            raise ValueError(f"rollout.kv_cache_dtype is {self.kv_cache_dtype} but rollout.sglang carries "
                             f"--kv-cache-dtype {flag}: set one of them (the field adds the flag itself)")
        if self.kv_scales == "calibrated" and self.kv_storage == "auto":
            raise ValueError("rollout.kv_scales: calibrated scales an FP8 cache; set rollout.kv_cache_dtype: "
                             "fp8_e4m3 or fp8_e5m2, or kv_scales: unit")
        if self.kv_scales == "calibrated" and self.engine == "sglang":
            raise ValueError("rollout.kv_scales: calibrated with rollout.engine: sglang: SGLang reads KV scales only "
                             "at startup (--quantization-param-path) and a weight update cannot change them "
                             "(docs/fp8-kv.md); use kv_scales: unit (SGLang's 1.0) or the in-process engine")
        return self


class LoraSection(Section):
    """LoRA in place of full fine-tuning (rank 0, the default: every weight trains). The base stays
    frozen; only the adapter trains and is pushed to the rollout engine."""

    rank: int = Field(0, ge=0, le=1024)
    # LoRA's update is scaled by alpha / rank; "LoRA Without Regret" (Thinking Machines, 2025) keeps 32
    alpha: float = Field(32.0, gt=0)
    # "all-linear": every linear layer of the transformer blocks (attention and MLP) but the LM head,
    # which that study found needed for RL to match full fine-tuning; or module names (q_proj, ...)
    target_modules: Literal["all-linear"] | list[Annotated[str, Field(min_length=1)]] = "all-linear"
    dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or \"all-linear\"")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0


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
    lora: LoraSection = Field(default_factory=LoraSection, json_schema_extra=HASHED_WHEN_SET)


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
