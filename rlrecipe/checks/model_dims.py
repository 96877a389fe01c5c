"""A recipe's model dimensions, from its config.json: a local model directory, the local hub cache,
or the copy shipped in rlrecipe/model_configs/ for the recipes' hub models; tiny models from the
recipe itself. What the memory plan and the step-time model size everything by."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe, load_recipe
from rlrecipe.recipe.training import ModelSection

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1}  # rollout.kv_cache_dtype; "auto" stores rollout.dtype
SHIPPED_CONFIGS = Path(__file__).parent.parent / "model_configs"
TINY_TOKENIZER_SIZE = 261  # the character tokenizer: 4 specials + 256 bytes + `\boxed{`


def kv_bytes(rollout) -> int:
    """Bytes of one cached K or V element: 1 in FP8 (the field, or SGLang's flag), else rollout.dtype's."""
    return KV_BYTES.get(rollout.kv_storage, BYTES[rollout.dtype])


@dataclass(frozen=True)
class ModelDims:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """One token's K and V over all layers, at `element_bytes` a cached element."""
        return 2 * self.layers * self.kv_dim * element_bytes

    def layer_params(self) -> int:
        """One Qwen2 decoder layer: q/k/v with bias, o without, SwiGLU MLP, two RMSNorms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_dim
        return (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * self.intermediate + 2 * h

    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each linear layer of one decoder block: (in, out) features, by its name in a Qwen2 model."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, targets: str | list[str] = "all-linear") -> int:
        """A LoRA adapter's parameters: A (rank x in) and B (out x rank) for every target linear layer of
        every block; "all-linear" is all seven (attention and MLP), not the LM head."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else list(targets)
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise UserError(f"trainer.lora.target_modules: {', '.join(unknown)} not among a block's linear "
                            f"layers ({', '.join(shapes)}); or \"all-linear\"")
        return self.layers * sum(rank * sum(shapes[n]) for n in names)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelDims:
        return cls(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                   layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                   kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                   tied=bool(cfg.get("tie_word_embeddings", False)))


def _hub_config(model_id: str, revision: str | None) -> dict | None:
    """config.json from the local hub cache, else the copy shipped for the recipes' models."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_id, "config.json", revision=revision)
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text())
    except Exception:  # noqa: BLE001 - no cache, odd id: fall through to the shipped copy
        pass
    shipped = SHIPPED_CONFIGS / (model_id.replace("/", "__") + ".json")
    return json.loads(shipped.read_text()) if shipped.exists() else None


def model_dims(loaded: LoadedRecipe, seen: tuple[str, ...] = ()) -> ModelDims:
    """The recipe's model dimensions (see the module docstring for where they come from)."""
    recipe = loaded.recipe
    init = recipe.run.init_from
    if init:
        if init.startswith("run:"):
            name = init[4:]
            final = Path(recipe.run.output_dir) / name / "final" / "config.json"
            if final.exists():
                return ModelDims.from_config(json.loads(final.read_text()))
            return model_dims(_recipe_of_run(loaded, name, seen), (*seen, name))
        cfg = Path(init) / "config.json"
        if not cfg.exists():
            raise UserError(f"{loaded.path}: run.init_from: no config.json at {cfg}")
        return ModelDims.from_config(json.loads(cfg.read_text()))
    return _section_dims(recipe.model, loaded.path)


def _section_dims(m: ModelSection, where: str) -> ModelDims:
    if m.tiny is not None:
        t = m.tiny
        return ModelDims(vocab=t.vocab_size or TINY_TOKENIZER_SIZE, hidden=t.hidden_size,
                         intermediate=t.intermediate_size, layers=t.num_layers, heads=t.num_heads,
                         kv_heads=t.num_kv_heads, tied=t.tie_word_embeddings)
    assert m.path is not None
    local = Path(m.path) / "config.json"
    if local.exists():
        return ModelDims.from_config(json.loads(local.read_text()))
    cfg = _hub_config(m.path, m.revision)
    if cfg is None:
        raise UserError(f"{where}: model.path: no config.json for {m.path!r} (not a local directory, not in the "
                        "hub cache, not shipped); download the model first")
    return ModelDims.from_config(cfg)


def _recipe_of_run(loaded: LoadedRecipe, name: str, seen: tuple[str, ...]) -> LoadedRecipe:
    """The recipe beside this one whose run.name is `name` (the stage that makes init_from)."""
    if name in seen:
        raise UserError(f"{loaded.path}: run.init_from: run:{name} starts from itself")
    for path in sorted(Path(loaded.path).parent.glob("*.yaml")):
        other = load_recipe(path, [])
        if other.recipe.run.name == name:
            return other
    raise UserError(f"{loaded.path}: run.init_from: run:{name} has no final model yet and no recipe beside this "
                    f"one is named {name}; run that stage first")
