"""A DeepSpeed engine's training state in a checkpoint directory: DeepSpeed's own checkpoint in
`deepspeed/` (every rank writes its optimizer shard; module, scheduler and `steps_done` from rank 0)
and each rank's RNG state beside it. Resuming needs the same number of ranks. The HF export (or under
trainer.lora the adapter) is the engine's to write."""

from __future__ import annotations

from pathlib import Path

import torch

from rlrecipe.core.errors import UserError
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


def load_deepspeed_state(engine, ckpt_dir: str | Path, rank: int, frozen_base: bool) -> int:
    """Every rank: its share of the state restored, RNG included; returns the steps done."""
    ds_dir = Path(ckpt_dir) / CKPT_SUBDIR
    rng_file = _rng_file(ds_dir, rank)
    if not rng_file.exists():
        raise UserError(f"{ckpt_dir}: no DeepSpeed state for rank {rank} (resume with the same "
                        "trainer.nproc * trainer.nodes and trainer.engine: deepspeed)")
    from rlrecipe.train.deepspeed_safe_load import use_weights_only_loading

    use_weights_only_loading(engine)  # a tampered file cannot run code while loading
    path, client = engine.load_checkpoint(str(ds_dir), tag=CKPT_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True,
                                          load_module_strict=not frozen_base)  # frozen base left out
    if path is None:
        raise UserError(f"{ds_dir}: DeepSpeed could not load the checkpoint")
    steps_done = int(client["steps_done"])
    restore_rng(load_state(rng_file))
    return steps_done
