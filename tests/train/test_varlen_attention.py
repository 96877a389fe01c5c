"""Per-document attention for packed micro-batches on CPU: the same numbers as one sequence at a time."""

import pytest
import torch

from rlrecipe.algo.packing import pack
from rlrecipe.modeling import enable_checkpointing, load_model
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine
from rlrecipe.train.varlen_attention import (
    NAME,
    document_bounds,
    register,
    training_attention,
    varlen_sdpa_forward,
)


def test_document_bounds_from_restarting_positions():
    assert document_bounds(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [(0, 3), (3, 4), (4, 6)]
    assert document_bounds(torch.tensor([0, 1, 2, 3])) == [(0, 4)]
    # a row that starts mid-document (never produced by pack, but bounded all the same)
    assert document_bounds(torch.tensor([5, 6, 0, 1])) == [(0, 2), (2, 4)]


def test_which_attention_a_trainer_loads():
    assert training_attention("sdpa") == NAME
    assert training_attention("eager") == "eager"
    assert training_attention("flash_attention_2") == "flash_attention_2"


def test_packed_forward_and_gradients_equal_one_sequence_at_a_time(tiny_model_dir):
    torch.manual_seed(0)
    packed_model = load_model(tiny_model_dir, "float32", register())
    alone_model = load_model(tiny_model_dir, "float32", "eager")  # an independent attention path
    seqs = [torch.randint(3, 60, (n,)).tolist() for n in (17, 1, 40, 5)]
    ids, pos = pack(seqs)
    packed = packed_model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    alone = torch.cat([alone_model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs])
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    # a mistake that attends across documents shows: the plain causal row differs after the first
    across = alone_model(input_ids=ids, use_cache=False).logits[0]
    assert (across[17:] - alone[17:]).abs().max() > 1e-3
    weights = torch.randn_like(packed)
    (packed * weights).sum().backward()
    (alone * weights).sum().backward()
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_padding_or_several_rows_are_refused():
    q = torch.zeros(2, 4, 3, 8)
    with pytest.raises(ValueError, match="one packed row"):
        varlen_sdpa_forward(None, q, q, q, None, position_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mask set"):
        varlen_sdpa_forward(None, q[:1], q[:1], q[:1], torch.ones(1, 1, 3, 3), position_ids=torch.zeros(1, 3))


def test_the_trainer_attends_per_document_and_exports_a_plain_model(tiny_model_dir, tmp_path):
    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(max_tokens_per_microbatch=4096), total_steps=1)
    assert eng.model.config._attn_implementation == NAME
    samples = [TrainSample(list(range(3, 3 + n)), 2) for n in (9, 30, 4)]
    (packed_lp, _), = [eng.compute_logprobs(samples)[1]]
    (alone_lp, _), = eng.compute_logprobs([samples[1]])
    torch.testing.assert_close(packed_lp, alone_lp, atol=2e-5, rtol=1e-4)
    from transformers import AutoTokenizer

    out = eng.export_hf(tmp_path / "export", AutoTokenizer.from_pretrained(tiny_model_dir))
    reloaded = load_model(out)  # the default attention: the export does not name varlen_sdpa
    assert reloaded.config._attn_implementation == "sdpa"


def test_document_lengths_are_found_once_per_forward_also_under_checkpointing(tiny_model_dir, monkeypatch):
    """Every layer gets the same position ids: one search of them a forward (a device sync on CUDA),
    and a new search for the next micro-batch's, or for the same tensor changed in place."""
    import rlrecipe.train.varlen_attention as varlen

    searched = []
    real = varlen.document_bounds
    monkeypatch.setattr(varlen, "document_bounds", lambda pos: searched.append(pos.tolist()) or real(pos))
    model = load_model(tiny_model_dir, "float32", register())
    enable_checkpointing(model)
    model.train()
    assert model.config.num_hidden_layers > 1
    ids, pos = pack([[5, 6, 7], [8, 9]])
    model(input_ids=ids, position_ids=pos, use_cache=False).logits.sum().backward()  # recompute included
    assert searched == [[[0, 1, 2, 0, 1]]]
    ids2, pos2 = pack([[5, 6], [7, 8, 9]])
    with torch.no_grad():
        model(input_ids=ids2, position_ids=pos2, use_cache=False)
        assert varlen.document_lengths(pos2) == [2, 3] and len(searched) == 2
        pos2[0, 2] = 2  # one document of 5 now
        assert varlen.document_lengths(pos2) == [5] and len(searched) == 3
