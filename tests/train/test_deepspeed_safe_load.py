"""DeepSpeed checkpoints are read weights-only: DeepSpeed's own state loads, anything else is refused."""

import pytest
import torch

from rlrecipe.core.errors import UserError

ds_load = pytest.importorskip("rlrecipe.train.deepspeed_safe_load")


class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


def test_a_tampered_optimizer_file_is_refused_before_it_runs(tmp_path):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    marker = tmp_path / "code_ran"
    torch.save({"optimizer_state_dict": {"state": {}}, "extra": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(UserError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: not loaded"):
        ds_load.WeightsOnlyCheckpointEngine(None).load(str(path), map_location="cpu")
    assert not marker.exists()


def test_deepspeed_optimizer_state_types_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(init_scale=2.0**32, scale_window=5,
                                                                           min_scale=1.0, delayed_shift=2,
                                                                           consecutive_hysteresis=False),
             "zero_stage": ZeroStageEnum.gradients, "param_slice_mappings": [{"w": fragment_address(numel=6, start=2)}],
             "fp32_flat_groups": [torch.arange(6.0)]}
    path = tmp_path / "optim.pt"
    torch.save(state, path)
    got = ds_load.WeightsOnlyCheckpointEngine(None).load(str(path), map_location="cpu")
    assert got["zero_stage"] is ZeroStageEnum.gradients
    assert got["dynamic"].cur_scale == 2.0**32 and got["dynamic"].scale_window == 5
    assert got["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=2)
    assert torch.equal(got["fp32_flat_groups"][0], torch.arange(6.0))
