"""Chunked log-probs and entropies equal the full-logits computation, forward and gradient."""

import pytest
import torch

from rlrecipe.algo.packing import pack
from rlrecipe.modeling import build_tiny_model
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.systems import TrainerSection
from rlrecipe.recipe.training import TinyModel
from rlrecipe.train.base import TrainSample
from rlrecipe.train.logprobs import chunk_sizes, response_logprobs, token_logprobs


def full_logits_reference(model, seqs: list[list[int]], starts: list[int], temperature: float):
    """The plain path, written independently: all logits of the packed batch, log_softmax, gather."""
    ids, pos = pack(seqs)
    logits = model(input_ids=ids.to(model.device), position_ids=pos.to(model.device),
                   use_cache=False).logits[0].float().cpu() / temperature
    logp_all, rows, targets, off = torch.log_softmax(logits, -1), [], [], 0
    for s, st in zip(seqs, starts, strict=True):
        rows += range(off + st - 1, off + len(s) - 1)
        targets += s[st:]
        off += len(s)
    sel = logp_all[torch.tensor(rows)]
    logp = sel.gather(-1, torch.tensor(targets)[:, None]).squeeze(-1)
    entropy = -(sel.exp() * sel).sum(-1)
    return logp, entropy, torch.tensor(rows), torch.tensor(targets)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                                      intermediate_size=64, vocab_size=3001), 300, seed=3, pad_id=0, eos_id=1)


def test_padded_vocab_and_refusal():
    m = build_tiny_model(TinyModel(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32,
                                   vocab_size=500), 260, seed=1, pad_id=0, eos_id=1)
    assert m.get_output_embeddings().weight.shape[0] == 500
    with pytest.raises(RecipeError, match="smaller than the tokenizer"):
        build_tiny_model(TinyModel(vocab_size=100), 260, seed=1, pad_id=0, eos_id=1)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_equals_full_logits_forward_and_gradient(model, chunk):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 3001, (n,), generator=g).tolist() for n in (23, 9, 31)]
    starts = [5, 2, 11]
    temperature = 0.7

    model.zero_grad()
    ref_lp, ref_ent, rows, targets = full_logits_reference(model, seqs, starts, temperature)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    ids, pos = pack(seqs)
    lp, ent = response_logprobs(model, ids, pos, rows, targets, temperature, chunk_tokens=chunk, with_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()

    assert lp.shape == (sum(len(s) - st for s, st in zip(seqs, starts, strict=True)),)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=2e-5, rtol=1e-4, msg=n)


def test_token_logprobs_hand_values():
    """A 2-token vocabulary: log-probs and entropy from hand-derived softmax values."""
    head = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0], [0.0]]))  # logits (h, 0)
    hidden = torch.tensor([[0.0], [2.0]])
    lp, ent = token_logprobs(head, hidden, torch.tensor([0, 1]), temperature=2.0, chunk_tokens=1, with_entropy=True)
    # row 0: logits (0, 0) -> p = (1/2, 1/2); row 1: logits (1, 0) after T = 2 -> p0 = e/(e+1)
    p0 = torch.e / (torch.e + 1)
    expected_lp = torch.tensor([torch.log(torch.tensor(0.5)), torch.log(torch.tensor(1 - p0))])
    expected_ent = torch.tensor([torch.log(torch.tensor(2.0)),
                                 -(p0 * torch.log(torch.tensor(p0)) + (1 - p0) * torch.log(torch.tensor(1 - p0)))])
    torch.testing.assert_close(lp, expected_lp.float())
    torch.testing.assert_close(ent, expected_ent.float())


def test_engine_uses_the_chunked_path(tmp_path, model):
    """The torch engine's log-probs match the reference at a chunk size that splits every sample."""
    from rlrecipe.train.torch_engine import TorchTrainEngine

    model.save_pretrained(tmp_path)
    eng = TorchTrainEngine(tmp_path, TrainerSection(logprob_chunk_tokens=4), total_steps=1, temperature=0.7)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 3001, (n,), generator=g).tolist() for n in (12, 20)]
    out = eng.compute_logprobs([TrainSample(s, 3) for s in seqs])
    ref_lp, ref_ent, _, _ = full_logits_reference(eng.model, seqs, [3, 3], 0.7)
    torch.testing.assert_close(torch.cat([lp for lp, _ in out]).cpu(), ref_lp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([en for _, en in out]).cpu(), ref_ent.detach(), atol=2e-5, rtol=1e-5)


def test_chunk_sizes_put_the_remainder_first():
    assert chunk_sizes(0, 4) == []
    assert chunk_sizes(3, 4) == [3]
    assert chunk_sizes(8, 4) == [4, 4]
    assert chunk_sizes(9, 4) == [1, 4, 4]


def test_every_chunk_but_the_last_is_recomputed_in_backward():
    """The head runs once per chunk forward, and again in backward for every chunk but the last,
    whose logits are still held when its backward runs (recomputing it would not lower the peak)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    calls = []
    head.register_forward_hook(lambda _m, inp, _out: calls.append(inp[0].shape[0]))
    hidden = torch.randn(23, 8, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    lp, _ = token_logprobs(head, hidden, targets, chunk_tokens=10)
    assert calls == [3, 10, 10]  # the remainder first
    lp.sum().backward()
    assert sorted(calls[3:]) == [3, 10]  # the first two chunks recomputed, not the last
    with torch.no_grad():
        calls.clear()
        token_logprobs(head, hidden, targets, chunk_tokens=10)
    assert calls == [3, 10, 10]
