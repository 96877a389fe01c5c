"""The typed recipe schema: the single source of truth for every setting of every stage.

A recipe is a YAML file whose top-level keys are the sections `Recipe` assembles here. Loading
resolves `--set a.b.c=value` overrides, validates types, rejects unknown keys, and computes a
sha256 over the canonical resolved form so that every reported number can be pinned to exactly the
configuration that produced it.

The sections live beside this module, each with its cross-field checks: what is trained and how in
`training.py`, where it runs in `systems.py`, their common base in `base.py`; import each from
where it is defined. The sha256 covers exactly what the three define. The refusals that read across
sections, which `Recipe`'s validators raise and the pre-run checks ask too, are in `refusals.py`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from rlrecipe.recipe.base import HASHED_WHEN_SET, RecipeError, Section
from rlrecipe.recipe.refusals import ELSEWHERE, LOCAL_HOSTS, ipc_refusal, rl_lora_refusal
from rlrecipe.recipe.systems import (
    EvalSection,
    RolloutSection,
    RunSection,
    TrainerSection,
)
from rlrecipe.recipe.training import (
    DataSection,
    ModelSection,
    RLSection,
    SFTSection,
)


def _digest(data: dict) -> str:
    """sha256 of the canonical JSON form (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _drop_unset_additions(section: BaseModel, dumped: dict) -> dict:
    """`dumped` without the fields marked HASHED_WHEN_SET that hold their default, in every section."""
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if field.json_schema_extra == HASHED_WHEN_SET and value == field.get_default(call_default_factory=True):
            dumped.pop(name, None)
        elif isinstance(value, BaseModel) and isinstance(dumped.get(name), dict):
            _drop_unset_additions(value, dumped[name])
    return dumped


# Which fields decide what is trained: the rule, per section, is "would a machine with exact
# arithmetic compute something else?". In: the objective, the data, the sampling policy, the
# optimizer, and the dtypes (they change the arithmetic itself: the precision of the weights that
# train and of the policy that samples). Out: where it runs (GPUs, ranks, servers, ZeRO stage,
# offload), how it is cut into work (micro-batch tokens, log-prob chunks, hence gradient
# accumulation, as the loss averages over the whole minibatch), kernels (attention, gradient
# checkpointing, the rollout engine), bookkeeping (names, seed, checkpoints, tracking) and the
# evaluation, whose settings each RESULTS.md row shows on its own. "*" = the whole section.
# tests/test_recipe.py holds every field of the schema to one of the two sets.
ALGORITHM_FIELDS: dict[str, set[str]] = {
    "run": {"init_from"},
    "model": {"path", "revision", "tiny", "dtype"},
    "data": {"*"},
    "sft": {"epochs", "max_steps", "batch_size", "max_length"},
    "rl": {"steps", "prompts_per_step", "samples_per_prompt", "ppo_minibatches", "eps_clip_low", "eps_clip_high",
           "dual_clip", "adv_norm", "loss_agg", "reward_correct", "reward_wrong", "kl_coef", "kl_estimator",
           "ratio_level", "gspo_eps_low", "gspo_eps_high", "cov", "entropy_coef", "entropy_watch",
           "negative_adv_scale", "icepop", "offpolicy_seq_delta", "early_stop_imp_ratio", "c3po", "async_lag",
           "adv_quantile", "dynamic_sampling", "overlong", "max_token_staleness"},
    "rollout": {"dtype", "temperature", "top_p", "top_k", "max_new_tokens", "weight_update_every",
                "stress_logit_noise", "kv_cache_dtype", "kv_scales"},
    "trainer": {"engine", "lr", "lr_schedule", "warmup_ratio", "warmup_steps", "min_lr_ratio", "weight_decay",
                "adam_betas", "adam_eps", "grad_clip", "bf16_autocast", "fp16_autocast", "lora"},
    "eval": set(),
}
LAYOUT_FIELDS: dict[str, set[str]] = {
    "run": {"name", "output_dir", "seed", "keep_checkpoints", "tracking"},
    "model": {"attn_implementation", "gradient_checkpointing"},
    "data": set(),
    "sft": {"eval_every", "save_every"},
    "rl": {"eval_every", "save_every", "max_bad_steps"},
    "rollout": {"engine", "max_batch", "refill_fraction", "urls", "sglang", "colocate"},
    "trainer": {"max_tokens_per_microbatch", "logprob_chunk_tokens", "gpu_memory_gib", "zero_stage",
                "offload_optimizer", "offload_params", "nproc", "nodes", "master_addr", "master_port"},
    "eval": {"*"},
}


# SGLang launch flags that change what is sampled (the KV cache's precision, quantized weights, the
# served dtype): they sit in a layout field, rollout.sglang.extra_args or launch_cmd, yet enter the
# algorithm hash, as rollout.sglang_numerics, where present (absent, the hash is as before).
NUMERICS_FLAGS = ("--kv-cache-dtype", "--quantization", "--dtype", "--enable-fp32-lm-head")


def sglang_numerics(args: list[str]) -> list[str]:
    """The numerics-changing flags of an SGLang command line and their values, in order."""
    out = []
    for i, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if name not in NUMERICS_FLAGS:
            continue
        if "=" in arg:
            out.append(arg)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{arg}={args[i + 1]}")
        else:
            out.append(arg)
    return out


def algorithm_fields(hashed: dict) -> dict:
    """The part of a recipe's hashed form that ALGORITHM_FIELDS names, with the numerics-changing
    SGLang flags where the rollout engine is SGLang and its command carries any."""
    out = {}
    for section, keep in ALGORITHM_FIELDS.items():
        body = hashed.get(section) or {}
        out[section] = dict(body) if "*" in keep else {k: v for k, v in body.items() if k in keep}
    rollout = hashed.get("rollout") or {}
    sglang = rollout.get("sglang") or {}
    if rollout.get("engine") == "sglang":
        # "--dtype {dtype}" in a launch_cmd is rollout.dtype, hashed already
        flags = [f for f in sglang_numerics(list(sglang.get("extra_args") or []) + list(sglang.get("launch_cmd") or []))
                 if f != "--dtype={dtype}"]
        if flags:
            out["rollout"]["sglang_numerics"] = flags
    return out


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
        sync = self.rollout.sglang.weight_sync
        if lag > 1 and self.rollout.engine == "sglang" and sync in ("distributed", "tensor", "ipc"):
            raise ValueError(f"rl.async_lag > 1 with rollout.sglang.weight_sync: {sync} would push weights into "
                             "servers that are generating; use weight_sync: disk or async_lag: 1")
        return self

    @model_validator(mode="after")
    def _handles_stay_on_their_machine(self) -> Recipe:
        ro, tr = self.rollout, self.trainer
        if ro.engine != "sglang" or ro.sglang.weight_sync != "ipc" or ro.colocate:
            return self  # colocated, every server reads the trainer rank on its own GPU
        far = [u for u in ro.urls if urlsplit(u if "//" in u else f"http://{u}").hostname not in LOCAL_HOSTS]
        sg = ro.sglang
        why = f"rollout.urls {far[0]}: {ELSEWHERE}" if far else ipc_refusal(
            colocated=False, trainer_nodes=tr.nodes, rollout_nodes=sg.nodes,
            server_gpus=0 if ro.urls else sg.num_servers * sg.tp_size, trainer_ranks=tr.nproc)
        if why is not None:  # attached servers' GPUs are checked at the first push (their /server_info)
            raise ValueError(f"rollout.sglang.weight_sync: ipc with {why}")
        return self

    @model_validator(mode="after")
    def _colocated_gpus(self) -> Recipe:
        ro, tr = self.rollout, self.trainer
        if not ro.colocate:
            return self
        if self.rl.async_lag:
            raise ValueError(f"rollout.colocate with rl.async_lag {self.rl.async_lag}: on shared GPUs rollout and "
                             "training take turns, so there is nothing to overlap; set async_lag: 0 or colocate: false")
        if ro.weight_update_every > 1:
            raise ValueError(f"rollout.colocate with rollout.weight_update_every {ro.weight_update_every}: a released "
                             "engine discards its weights, so every step pushes them; set weight_update_every: 1")
        if ro.engine == "sglang" and ro.sglang.weight_sync == "distributed":
            raise ValueError("rollout.colocate with rollout.sglang.weight_sync: distributed: a broadcast group cannot "
                             "hold two ranks on one GPU; use weight_sync: ipc, tensor or disk")
        if ro.engine == "sglang" and not ro.urls:
            sg = ro.sglang
            server_gpus, trainer_gpus = sg.num_servers * sg.tp_size * sg.dp_size, tr.nproc * tr.nodes
            if server_gpus != trainer_gpus or sg.nodes != tr.nodes:
                raise ValueError(f"rollout.colocate: the servers take {server_gpus} GPUs on {sg.nodes} node(s) "
                                 f"(num_servers x tp_size x dp_size) and the trainer {trainer_gpus} on {tr.nodes} "
                                 "(nproc x nodes); colocated, they share the same GPUs, so make them equal")
        return self

    @model_validator(mode="after")
    def _noise_needs_inprocess(self) -> Recipe:
        if self.rollout.stress_logit_noise > 0 and self.rollout.engine != "inprocess":
            raise ValueError("rollout.stress_logit_noise is a stress test of the in-process engine; "
                             "set it to 0 with rollout.engine: sglang")
        return self

    @model_validator(mode="after")
    def _lora_for_rl(self) -> Recipe:
        # a recipe with an rl: section is an RL one (an SFT recipe sets none); `rlrecipe rl` checks the rest
        why = rl_lora_refusal(self) if "rl" in self.model_fields_set else None
        if why is not None:
            raise ValueError(why)
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

    def algorithm_sha256(self) -> str:
        """The sha256 of what decides what is trained, without where and how fast it runs: every field
        of ALGORITHM_FIELDS. A recipe fitted to other GPUs (`rlrecipe fit`) keeps it; so do seeds."""
        return _digest(algorithm_fields(self.hashed()))

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
        if _takes_text(keys):
            written = item.split("=", 1)[1].strip()
            if isinstance(value, (dict, list)):
                kind = "a mapping" if isinstance(value, dict) else "a list"
                raise RecipeError(f"--set {item!r}: {'.'.join(keys)} takes text, not {kind}; quote the value "
                                  "if the braces or brackets are part of the text")
            if not isinstance(value, str) or any(ord(c) < 32 for c in written):
                # a text field takes the text as written: YAML would read `off` as false, `2024` as a
                # number, and fold a newline into a space (the field's own check sees the newline)
                value = written
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
