"""A DeepSpeed engine's training state in a checkpoint directory: DeepSpeed's own checkpoint in
`deepspeed/` (every rank writes its optimizer shard; module, scheduler and `steps_done` from rank 0)
and each rank's RNG state beside it. Resuming needs the same number of ranks. The HF export (or under
trainer.lora the adapter) is the engine's to write."""

from __future__ import annotations

from pathlib import Path

import torch

from rlrecipe.core.errors import UserError
from rlrecipe.train import lora
from rlrecipe.train.torch_engine import capture_rng, load_state, restore_rng

CKPT_SUBDIR = "deepspeed"
CKPT_TAG = "state"


def _rng_file(ds_dir: Path, rank: int) -> Path:
    return ds_dir / f"rng_rank{rank:05d}.pt"


def save_deepspeed_state(engine, ckpt_dir: Path, rank: int, steps_done: int, frozen_base: bool) -> None:
    """Every rank: its share of the state; `frozen_base` (trainer.lora) leaves the base weights out."""
    ds_dir = ckpt_dir / CKPT_SUBDIR
    ds_dir.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(ds_dir), tag=CKPT_TAG, client_state={"steps_done": steps_done},
                           exclude_frozen_parameters=frozen_base)
    torch.save(capture_rng(), _rng_file(ds_dir, rank))


def check_adapter(ckpt_dir: Path, adapter: dict[str, torch.Size] | None) -> None:
    """Under trainer.lora (`adapter`: the model's adapter tensors' names and shapes) the checkpoint's
    adapter must be exactly the model's, as the torch engine checks it; without, the checkpoint must
    not be a LoRA one. One line, before DeepSpeed reads anything."""
    saved = Path(ckpt_dir) / lora.ADAPTER_DIR
    if adapter is not None:
        lora.read_adapter(saved, adapter)
    elif saved.exists():
        raise UserError(f"{ckpt_dir}: a trainer.lora checkpoint (an adapter, no model) resumed without trainer.lora; "
                        "resume it with the trainer.lora it was written with")


def _exactly_the_adapter(ds_dir: Path):
    """DeepSpeed's module load under trainer.lora. The checkpoint leaves the frozen base out, so a
    lenient load_state_dict would also pass over adapter tensors missing from it or extra in it."""
    def load(src: dict, dst: torch.nn.Module) -> None:
        frozen = {n for n, p in dst.named_parameters() if not p.requires_grad}
        differ = set(src) ^ (set(dst.state_dict()) - frozen)
        if differ:
            raise UserError(f"{ds_dir}: its module state is not this model's adapter ({len(differ)} names differ, "
                            f"e.g. {sorted(differ)[0]})")
        dst.load_state_dict(src, strict=False)  # the frozen base stays as the model was loaded

    return load


def load_deepspeed_state(engine, ckpt_dir: str | Path, rank: int, adapter: dict[str, torch.Size] | None) -> int:
    """Every rank: its share of the state restored, RNG included; returns the steps done. `adapter`:
    under trainer.lora, the model's adapter (names and shapes), which the checkpoint must hold exactly."""
    ds_dir = Path(ckpt_dir) / CKPT_SUBDIR
    rng_file = _rng_file(ds_dir, rank)
    if not rng_file.exists():
        raise UserError(f"{ckpt_dir}: no DeepSpeed state for rank {rank} (resume with the same "
                        "trainer.nproc * trainer.nodes and trainer.engine: deepspeed)")
    check_adapter(Path(ckpt_dir), adapter)
    from rlrecipe.train.deepspeed_safe_load import use_weights_only_loading

    use_weights_only_loading(engine)  # a tampered file cannot run code while loading
    path, client = engine.load_checkpoint(str(ds_dir), tag=CKPT_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True,
                                          custom_load_fn=None if adapter is None else _exactly_the_adapter(ds_dir))
    if path is None:
        raise UserError(f"{ds_dir}: DeepSpeed could not load the checkpoint")
    steps_done = int(client["steps_done"])
    restore_rng(load_state(rng_file))
    return steps_done
