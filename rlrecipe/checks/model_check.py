"""A local model directory checked as a stage will read it, before anything is written or deleted.

Cheap on purpose (no weights are loaded): every safetensors file's header is read (a truncated
or overwritten file fails here, as its tensors no longer cover the file), the config is built on
the meta device and its tensor names and shapes compared with the files' (a config of another
architecture fails here), and the tokenizer is loaded (and must carry a chat template when the
recipe's prompt templates use one). Each problem is one RecipeError naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlrecipe.recipe.base import RecipeError

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def read_model_config(field: str, path: Path) -> dict:
    """The model's config.json as transformers reads it; a RecipeError naming the field otherwise."""
    if not path.is_dir():
        raise RecipeError(f"{field}: no model directory at {path}")
    config = path / "config.json"
    if not config.is_file():
        raise RecipeError(f"{field}: {path} has no config.json (not a Hugging Face model directory)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise RecipeError(f"{config}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{config}: expected a JSON object")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path)).to_dict()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RecipeError(f"{config}: transformers cannot read it: {err}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _checkpoint_hint(path: Path) -> str:
    """A checkpoint's trainer/model/ holds weights without a tokenizer: say where the usable model is."""
    parts = path.resolve().parts
    if any(p.startswith("step_") for p in parts) and path.name == "model":
        return "; it looks like a checkpoint's trainer/model/ (weights only): use the run's final/ or run:<name>"
    return ""


def weight_files(label: str, path: Path) -> list[Path] | None:
    """The safetensors files a loader reads (None: only PyTorch .bin weights, which are not checked here)."""
    index = path / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise RecipeError(f"{index}: unreadable shard index ({_first_line(err)})") from None
        return [path / str(n) for n in names]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    if any(path.glob("pytorch_model*.bin")):
        return None
    raise RecipeError(f"{label}: {path} has no weights (model.safetensors or {INDEX})")


def read_tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape from the files' headers; one error naming a file that is not
    readable safetensors."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise RecipeError(f"{f}: missing (listed by the model's shard index)")
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error type for any damage
            raise RecipeError(f"{f}: not a readable safetensors file ({_first_line(err)})") from None
    return shapes


def check_architecture(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The model config.json describes, built on the meta device (no memory), must hold the files' tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = path / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for an unusable config
        raise RecipeError(f"{config_file}: not a causal language model transformers can build "
                          f"({_first_line(err)})") from None
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    kind = getattr(config, "model_type", "?")
    common = own.keys() & shapes.keys()
    if shapes and not common:
        example = next(iter(sorted(shapes)))
        raise RecipeError(f"{config_file}: describes a {kind} model, but none of the {len(shapes)} tensors in the "
                          f"weights belongs to it (e.g. {example}): config and weights are of different models")
    for key in sorted(common):
        if own[key] != shapes[key]:
            raise RecipeError(f"{config_file}: describes {key} as {own[key]}, but the weights hold {shapes[key]}: "
                              "config and weights are of different models")
    tied = {k for k in own if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(own.keys() - shapes.keys() - tied)
    if missing:
        raise RecipeError(f"{path}: the weights lack {len(missing)} tensor(s) of the {kind} model config.json "
                          f"describes, e.g. {missing[:2]}")


def check_tokenizer(label: str, path: Path, chat_template: bool):
    """The tokenizer a stage loads from the model directory; returns it."""
    from rlrecipe.modeling import chat_template_text, load_tokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise RecipeError(f"{label}: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
                          + _checkpoint_hint(path))
    try:
        tokenizer = load_tokenizer(path)
    except Exception as err:  # noqa: BLE001 - tokenizers and transformers raise many kinds
        raise RecipeError(f"{label}: {path}: its tokenizer does not load ({_first_line(err)})") from None
    if chat_template and chat_template_text(tokenizer) is None:
        raise RecipeError(f"{label}: {path}: its tokenizer has no chat template, which the recipe's prompt template "
                          "uses (data.prompt_template / data.eval_template: raw or areal_boba need none)")
    return tokenizer


def check_model_dir(label: str, path: str | Path, chat_template: bool = False) -> None:
    """Weights, architecture and tokenizer of a local HF model directory (config.json already read)."""
    path = Path(path)
    files = weight_files(label, path)
    if files is not None:
        check_architecture(path, read_tensor_shapes(files))
    check_tokenizer(label, path, chat_template)


def templates_need_chat(recipe, training: bool) -> bool:
    """Whether the recipe formats prompts through the tokenizer's chat template: a training stage's
    prompts (data.prompt_template) and, when it has benchmarks, its evaluation's (data.eval_template)."""
    from rlrecipe.data.templates import TEXT_TEMPLATES

    used = [recipe.data.prompt_template] if training else []
    if recipe.eval.benchmarks or not training:
        used.append(recipe.data.eval_prompt_template)
    return any(t not in TEXT_TEMPLATES for t in used)


def check_eval_context(loaded, context: int) -> None:
    """Evaluation's generation must fit in the model's context: positions past it are garbage, not an error."""
    limit = loaded.recipe.eval.max_new_tokens
    if limit >= context:
        raise RecipeError(f"{loaded.path}: eval.max_new_tokens: {limit} leaves no room for a problem in the "
                          f"model's context of {context} tokens")


def check_eval_model(loaded, label: str, path: str | Path) -> None:
    """A model directory `rlrecipe eval` is about to evaluate."""
    path = Path(path)
    config = read_model_config(label, path)
    check_model_dir(label, path, chat_template=templates_need_chat(loaded.recipe, training=False))
    context = config.get("max_position_embeddings")
    if isinstance(context, int):
        check_eval_context(loaded, context)
