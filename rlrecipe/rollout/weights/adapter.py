"""A LoRA adapter on its way to the rollout servers (trainer.lora): PEFT's adapter_config and its
tensors, and where a push from disk reads them (a PEFT directory written by rank 0)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class Adapter:
    config: dict  # PEFT's adapter_config.json content
    tensors: dict[str, torch.Tensor]  # PEFT's names: base_model.model.<module>.lora_A.weight, ...
    path: Path | None = None  # its PEFT directory, once written (weight_sync disk)

    def frozen(self) -> Adapter:
        """A copy that later training steps do not move (an asynchronous run installs it later)."""
        return Adapter(dict(self.config), {n: t.detach().to("cpu", copy=True) for n, t in self.tensors.items()},
                       self.path)

    def write(self, out_dir: str | Path) -> Adapter:
        """The adapter as a PEFT directory (what /load_lora_adapter reads), written atomically enough:
        the weights first, the config last (SGLang reads the config first)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in self.tensors.items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(self.config, indent=2))
        return Adapter(self.config, self.tensors, out)
