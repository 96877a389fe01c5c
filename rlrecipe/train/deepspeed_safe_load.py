"""DeepSpeed checkpoints read with `torch.load(weights_only=True)`.

DeepSpeed's own checkpoint engine unpickles whatever a checkpoint file holds
(`weights_only=False`), so a tampered file in a shared run directory could run code when a run
resumes. This engine allows tensors, containers and the few DeepSpeed types its ZeRO optimizer
state really holds (found by loading real ZeRO-2/3 checkpoints of this project, fp32 and fp16);
anything else is refused with the file named.
"""

from __future__ import annotations

import pickle

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from rlrecipe.core.errors import UserError

ALLOWED_TYPES = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(ALLOWED_TYPES):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            first = (str(err).strip().splitlines() or ["unpickling refused"])[0]
            raise UserError(f"{path}: not loaded: it holds more than tensors and DeepSpeed's own state "
                            f"({first})") from None


def use_weights_only_loading(engine) -> None:
    """Make a DeepSpeed engine read its checkpoints through `WeightsOnlyCheckpointEngine`."""
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
