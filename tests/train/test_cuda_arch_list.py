"""DeepSpeed's op builder reads TORCH_CUDA_ARCH_LIST entries as numbers; Hopper images set "9.0a"
(seen on the H100 machine, where FusedAdam's build then failed): the engine hands it "9.0" while the op
builds, and the variable is as it was after."""

import os

from rlrecipe.train.deepspeed_setup import plain_cuda_arch_list


def test_arch_suffixes_are_dropped_while_an_op_builds(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0f+PTX")
    with plain_cuda_arch_list():
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a;10.0f+PTX"


def test_an_unset_list_stays_unset(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with plain_cuda_arch_list():
        assert "TORCH_CUDA_ARCH_LIST" not in os.environ
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
