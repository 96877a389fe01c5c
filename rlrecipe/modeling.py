"""Models and tokenizers: the tiny from-scratch factory and the HF loading path."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils import logging as transformers_logging

from rlrecipe.recipe.training import ModelSection, TinyModel

PAD, EOS, USER, ASSISTANT = "<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>"
# `\boxed{` is one token so the tiny model spends no capacity spelling it.
MULTI_CHAR_TOKENS = ["\\boxed{"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

transformers_logging.disable_progress_bar()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_char_tokenizer():
    """A byte-level tokenizer with no merges (one token per character), built locally.

    It is a genuine Qwen2Tokenizer (byte-level BPE with an empty merge list), so the saved
    directory loads with `AutoTokenizer.from_pretrained` exactly as it was built.
    """
    b2u = bytes_to_unicode()
    specials = [PAD, EOS, USER, ASSISTANT]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for byte in range(256):
        vocab[b2u[byte]] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS, pad_token=PAD, unk_token=EOS)
    tok.add_tokens([AddedToken(s, special=True) for s in specials], special_tokens=True)
    tok.add_tokens(MULTI_CHAR_TOKENS)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def build_tiny_model(cfg: TinyModel, vocab_size: int, seed: int, pad_id: int, eos_id: int):
    """Same config + seed -> bit-identical weights. `cfg.vocab_size` pads the embedding beyond
    the tokenizer's `vocab_size` rows."""
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        from rlrecipe.recipe.base import RecipeError

        raise RecipeError(f"model.tiny.vocab_size: {cfg.vocab_size} is smaller than the tokenizer ({vocab_size} tokens)")
    config = Qwen2Config(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        use_sliding_window=False,
    )
    gen = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    finally:
        torch.random.set_rng_state(gen)
    return model


def create_tiny(cfg: TinyModel, out_dir: str | Path, seed: int) -> Path:
    """Build the tiny model and tokenizer and save them as a normal HF directory."""
    out_dir = Path(out_dir)
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg, len(tok), seed, tok.pad_token_id, tok.eos_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                 attn_implementation=attn_implementation)
    return model


def distinct_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Named tensors without the repeats of tied weights (lm_head tied to the embeddings)."""
    seen: set[tuple[int, torch.Size]] = set()
    out = []
    for name, t in state.items():
        key = (t.data_ptr(), t.shape)
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward. transformers 5 renamed the call (the old name warns,
    and goes in v6); older releases have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def load_weights_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy an HF safetensors export (one file or shards) into an existing model, shard by shard.

    No second model is built, so peak memory is the model plus one shard. A tensor the export
    leaves out is accepted only when it is tied to one it holds (lm_head tied to embeddings)."""
    import json

    from safetensors.torch import load_file

    from rlrecipe.core.errors import UserError

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    own = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name in files:
            for key, tensor in load_file(path / name).items():
                if key not in own or own[key].shape != tensor.shape:
                    raise UserError(f"{path / name}: tensor {key} {tuple(tensor.shape)} does not fit the model "
                                    f"({tuple(own[key].shape) if key in own else 'no such parameter'})")
                own[key].copy_(tensor)
                loaded.add(key)
    held = {own[k].data_ptr() for k in loaded}
    missing = [k for k in own if k not in loaded and own[k].data_ptr() not in held]
    if missing:
        raise UserError(f"{path}: the export lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")


def read_export_for(model: torch.nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors export, read in full and checked against `model` (names,
    shapes, none missing but tied ones) without touching it: what a server swaps in only once the
    whole update has been read. Raises on any problem (the caller reports it)."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    own = model.state_dict()
    staged: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(path / name).items():
            if key not in own or own[key].shape != tensor.shape:
                raise ValueError(f"{path / name}: tensor {key} {tuple(tensor.shape)} does not fit the model "
                                 f"({tuple(own[key].shape) if key in own else 'no such parameter'})")
            staged[key] = tensor
    held = {own[k].data_ptr() for k in staged}
    missing = [k for k in own if k not in staged and own[k].data_ptr() not in held]
    if missing:
        raise ValueError(f"{path}: the export lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    return staged


def resolve_model_dir(section: ModelSection, init_from: str | None, work_dir: Path, seed: int) -> Path:
    """Where this stage's starting weights are: `init_from`, `model.path` (at `model.revision`), or
    a fresh tiny model built in `work_dir/init_model`."""
    if init_from:
        path = Path(init_from)
        if not (path / "config.json").exists():
            from rlrecipe.recipe.base import RecipeError

            raise RecipeError(f"run.init_from: no model at {path} (run the stage that makes it first)")
        return path
    if section.path:
        return hub_snapshot(section.path, section.revision)
    assert section.tiny is not None
    return create_tiny(section.tiny, work_dir / "init_model", seed)


# Files from_pretrained reads for a causal LM and its tokenizer (skips e.g. figures, .bin duplicates).
SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def _snapshot_commit(path: Path) -> str | None:
    """The commit of a huggingface_hub cache snapshot directory (`.../snapshots/<commit>`)."""
    real = path.resolve()
    return real.name if real.parent.name == "snapshots" and len(real.name) == 40 else None


def hub_snapshot(path: str, revision: str | None, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding `path` at `revision`: the directory itself, or a hub snapshot.

    Resolving the hub id once, here, means the trainer, the rollout engines and the tokenizer all
    read one snapshot, and its directory name is the commit that env.json records.
    """
    from rlrecipe.recipe.base import RecipeError

    local = Path(path)
    if local.is_dir():
        if revision is not None and _snapshot_commit(local) != revision:
            raise RecipeError(f"model.path {path} is a local directory, so model.revision {revision} cannot be "
                              "checked; give the hub id, or the hub cache directory .../snapshots/<revision>")
        return local
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        # Offline, say so: huggingface_hub 1.x otherwise asks the hub for a pinned commit's file list
        # and fails instead of reading the cached snapshot (2.x falls back to the cache by itself).
        got = snapshot_download(path, revision=revision, cache_dir=cache_dir, allow_patterns=SNAPSHOT_FILES,
                                local_files_only=hub_constants.HF_HUB_OFFLINE)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RecipeError(f"model.path {path} at revision {revision or 'main'}: cannot get it from the hub "
                          f"or its cache ({first})") from None
    return Path(got)


def chat_template_text(tokenizer) -> str | None:
    """The tokenizer's default chat template (some configs hold several, by name)."""
    tpl = tokenizer.chat_template
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    return tpl if isinstance(tpl, str) else None


def model_record(model_dir: Path, revision: str | None) -> dict:
    """What a run started from: the snapshot commit and the chat template it carries.

    DeepSeek changed the R1-Distill chat template after release (early snapshots end the
    generation prompt at `<｜Assistant｜>`, later ones add `<think>\\n`), so the template's sha256
    and how its generation prompt ends are recorded beside the commit."""
    import hashlib

    tok = load_tokenizer(model_dir)
    template = chat_template_text(tok)
    tail = None
    if template is not None:
        marker = "\u2063PROBLEM\u2063"  # invisible separators: cannot occur in a template
        text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                       tokenize=False)
        tail = text.split(marker, 1)[-1]
    return {"dir": str(model_dir), "revision_requested": revision, "revision_resolved": _snapshot_commit(model_dir),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "generation_prompt_suffix": tail}
