"""LoRA on the trainer's model (`trainer.lora`), through PEFT: the base frozen, only the adapter trains.

What leaves the trainer is either the adapter itself, in PEFT's format (what SGLang's
`/load_lora_adapter_from_tensors` and `/load_lora_adapter` read: the adapter_config and tensors
named `base_model.model.<module>.lora_A.weight`), or the weights with the adapter merged in, under
the base model's own names (what the in-process engine, an HF export and a full push take). The
merge is computed beside the base, never into it: merging and unmerging in place would move the
frozen weights by rounding at every push.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import LoraSection

ADAPTER_NAME = "default"  # PEFT's name for the one adapter a model carries
ADAPTER_DIR = "adapter"  # beside a checkpoint's and final/'s merged model


def lora_config(section: LoraSection):
    from peft import LoraConfig

    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout, bias="none",
                      target_modules=section.target_modules, task_type="CAUSAL_LM")


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer in the model (q_proj, gate_proj, lm_head, ...)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def check_targets(section: LoraSection, model: torch.nn.Module, where: str = "trainer.lora.target_modules") -> None:
    """One line for a target the model lacks, before PEFT's own error deep in its wrapping."""
    if section.target_modules == "all-linear":
        return
    have = linear_module_names(model)
    missing = [t for t in section.target_modules if t not in have]
    if missing:
        raise UserError(f"{where}: {', '.join(missing)} not among the model's linear layers "
                        f"({', '.join(sorted(have))}); or \"all-linear\"")


INIT_SEED = 0  # the adapter's A matrices are drawn from this seed: every engine and rank starts alike


def wrap(model: torch.nn.Module, section: LoraSection) -> torch.nn.Module:
    """The model with a fresh adapter on its target modules (B = 0: the policy is unchanged at start),
    drawn from its own seed whatever the process's RNG holds; every base weight frozen."""
    from peft import get_peft_model

    check_targets(section, model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return get_peft_model(model, lora_config(section))


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _lora_layers(peft_model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(the module's name in the base model, its LoRA layer) for every wrapped module."""
    from peft.tuners.lora import LoraLayer

    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def merged_weight(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W + delta in float32, whatever W's dtype: summed in bfloat16 the sum keeps W's 8 bits, and an
    update of 0.1% of W came out 78% off (56% of it survived)."""
    return weight.detach().float() + delta.detach().float()


@torch.no_grad()
def merged_layer(layer) -> Iterator[tuple[str, torch.Tensor]]:
    """A wrapped layer's own tensors under the base layer's names: its weight with the adapter merged
    (computed beside it, in float32), its bias as it is."""
    base = layer.get_base_layer()
    yield "weight", merged_weight(base.weight, layer.get_delta_weight(ADAPTER_NAME))
    if getattr(base, "bias", None) is not None:
        yield "bias", base.bias.detach()


@torch.no_grad()
def merged_state(peft_model) -> dict[str, torch.Tensor]:
    """The base model's state dict, its names as the base model has them, with every wrapped
    weight replaced by W + (alpha / r) B A, computed beside W (W itself is not touched) and kept in
    float32 (merged_weight); the other tensors as they are."""
    deltas = {f"{name}.weight": layer.get_delta_weight(ADAPTER_NAME) for name, layer in _lora_layers(peft_model)}
    out = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        value = value.detach()
        out[key] = merged_weight(value, deltas[key]) if key in deltas else value
    return out


def save_merged(hf_model, out_dir: str | Path, state: dict[str, torch.Tensor]) -> None:
    """The merged model as an HF directory in float32 (config.json says so): a 16-bit copy would round
    away the update its merged weights carry; the base's other tensors widen exactly (tied ones stay tied)."""
    wide: dict[int, torch.Tensor] = {}
    state = {k: wide.setdefault(v.data_ptr(), v.float()) if v.is_floating_point() else v for k, v in state.items()}
    hf_model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    config = Path(out_dir) / "config.json"
    written = json.loads(config.read_text())
    for key in [k for k in ("dtype", "torch_dtype") if k in written] or ["dtype"]:
        written[key] = "float32"  # save_pretrained wrote the model's own dtype
    config.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def adapter_tensors(peft_model) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it (`adapter_model.safetensors`): names without the adapter's own."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model).items()}


def adapter_config(peft_model) -> dict:
    """The adapter's `adapter_config.json`, as a dict (what SGLang's config_dict takes)."""
    config = peft_model.peft_config[ADAPTER_NAME].to_dict()
    if isinstance(config.get("target_modules"), (set, list, tuple)):
        config["target_modules"] = sorted(config["target_modules"])
    return json.loads(json.dumps(config))  # plain JSON values (PEFT's enums are str subclasses)


def adapter_bytes(peft_model) -> int:
    return sum(t.numel() * t.element_size() for t in adapter_tensors(peft_model).values())


def write_adapter(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors), as PEFT writes it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def save_adapter(peft_model, out_dir: str | Path) -> Path:
    return write_adapter(out_dir, adapter_config(peft_model), adapter_tensors(peft_model))


def read_adapter(adapter_dir: str | Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A PEFT directory's adapter tensors, refused unless they are exactly the `expected` names and shapes."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.exists():
        raise UserError(f"{adapter_dir}: no adapter_model.safetensors (a LoRA checkpoint's adapter)")
    state = load_file(str(path))
    differ = set(state) ^ set(expected) or {k for k, v in state.items() if v.shape != expected[k]}
    if differ:
        raise UserError(f"{path}: its tensors are not this recipe's adapter (trainer.lora changed since the "
                        f"checkpoint? {len(differ)} names or shapes differ, e.g. {sorted(differ)[0]})")
    return state


def load_adapter_into(peft_model, adapter_dir: str | Path) -> None:
    """Adapter weights from a PEFT directory into the model's adapter, every tensor accounted for."""
    from peft import set_peft_model_state_dict

    expected = {k: v.shape for k, v in adapter_tensors(peft_model).items()}
    set_peft_model_state_dict(peft_model, read_adapter(adapter_dir, expected))


def base_without_adapter(peft_model):
    """A context in which the model computes with the adapter off: the base policy (the KL reference)."""
    return peft_model.disable_adapter()
