import pytest
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.rollout import inprocess, packed_attention
from rlrecipe.rollout.inprocess import InProcessEngine, filter_logits
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory


def _engine(model_dir, dtype="float32", max_batch=16):
    tok = load_tokenizer(model_dir)
    return InProcessEngine(model_dir, tok.eos_token_id, tok.pad_token_id, dtype=dtype, max_batch=max_batch), tok


def _trajs(tok, n=12):
    # prompts of different lengths, so left padding and refills are exercised
    return [Trajectory(uid=str(i), prompt_ids=tok.encode(f"Add {i * 37} and {10**i}.")) for i in range(n)]


def _recompute(model, t):
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(t.prompt_ids)
    return lp[p - 1:-1].gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)


@pytest.mark.slow
def test_fp32_logprobs_match_full_recompute(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, max_batch=5)
    trajs = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=30), seed=1)
    model = load_model(tiny_model_dir)
    gaps = torch.cat([(_recompute(model, t) - torch.tensor(t.logp_infer)).abs() for t in trajs])
    assert gaps.max() < 1e-5
    assert all(t.status in (Status.FINISHED, Status.TRUNCATED) for t in trajs)
    assert all(len(t.versions) == len(t.response_ids) == len(t.logp_infer) for t in trajs)


def test_refill_joins_cache_rows_of_any_width_exactly(tiny_model_dir, monkeypatch):
    # partial responses of staggered lengths make rows end at different steps, so newcomers are
    # prefilled alone and joined to rows in flight, each side sometimes the wider one
    widths = []
    join = inprocess._Batch.join
    monkeypatch.setattr(inprocess._Batch, "join", lambda a, b: widths.append(
        (a.mask.shape[1], b.mask.shape[1])) or join(a, b))
    eng, tok = _engine(tiny_model_dir, max_batch=4)
    trajs = _trajs(tok, n=14)
    for i, t in enumerate(trajs):
        for j in range((i * 7) % 19):
            t.append(tok.encode("0123456789")[j % 10], 0.0, -1)
    eng.generate(trajs, SamplingParams(max_new_tokens=30), seed=1)
    assert any(a > b for a, b in widths) and any(a < b for a, b in widths)
    model = load_model(tiny_model_dir)
    for t in trajs:
        fresh = [i for i, v in enumerate(t.versions) if v == 0]
        gap = (_recompute(model, t)[fresh] - torch.tensor(t.logp_infer)[fresh]).abs()
        assert fresh and gap.max() < 1e-5


def test_bf16_engine_has_a_real_but_small_gap(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, dtype="bfloat16")
    trajs = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=30), seed=1)
    model = load_model(tiny_model_dir)
    gaps = torch.cat([(_recompute(model, t) - torch.tensor(t.logp_infer)).abs() for t in trajs])
    print(f"bf16 engine vs fp32 recompute: mean |dlogp| {gaps.mean():.2e}, max {gaps.max():.2e}")
    assert 0 < gaps.mean() < 0.05


def test_same_seed_same_samples_and_refill_does_not_change_greedy(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, max_batch=16)
    a = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=20), seed=7)
    b = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=20), seed=7)
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    wide = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=20, greedy=True))
    eng.max_batch = 3  # forces many refills and compactions
    narrow = eng.generate(_trajs(tok), SamplingParams(max_new_tokens=20, greedy=True))
    assert [t.response_ids for t in wide] == [t.response_ids for t in narrow]


def test_budget_interrupts_and_resume_appends_under_new_version(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, max_batch=16)
    trajs = _trajs(tok)
    # half of them already hold 25 tokens (left over from an earlier step), so they end first
    eng.generate(trajs[:6], SamplingParams(max_new_tokens=25), seed=1)
    for t in trajs[:6]:
        t.status = Status.RUNNING
    params = SamplingParams(max_new_tokens=40)
    eng.generate(trajs, params, token_budget=30, seed=2)
    done = [t for t in trajs if t.done]
    running = [t for t in trajs if t.status == Status.RUNNING]
    assert sum(len(t.response_ids) for t in done) >= 30
    assert running and any(t.response_ids for t in running)
    partial = {t.uid: len(t.response_ids) for t in running}
    eng.update_weights_from_state({k: v * 1.01 for k, v in load_model(tiny_model_dir).state_dict().items()}, 1)
    eng.generate(trajs, params, seed=3)
    assert all(t.done for t in trajs)
    for t in running:
        n = partial[t.uid]
        assert set(t.versions[:n]) <= {0} and set(t.versions[n:]) == {1}


def test_top_p_and_top_k_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    kept = torch.isfinite(filter_logits(logits, 3, 1.0))
    assert kept.tolist() == [[True, True, True, False]]


def _ragged(tok, n=9):
    # very different lengths: short prompts, long prompts, partial responses, and repeated sequences
    trajs = [Trajectory(uid=str(i), prompt_ids=tok.encode("Add 3 and 4." + " then add 5" * (i * i % 13)))
             for i in range(n)]
    for i, t in enumerate(trajs[::2]):
        for j in range(11 * i):
            t.append(tok.encode("0123456789")[j % 10], 0.0, -1)
    trajs += [Trajectory(uid=f"{t.uid}b", prompt_ids=list(t.prompt_ids)) for t in trajs[1:4]]
    return trajs


def test_packed_prefill_equals_padded_prefill_on_ragged_rows(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir)
    rows = _ragged(tok)
    lens = [len(t.prompt_ids) + len(t.response_ids) for t in rows]
    assert max(lens) > 5 * min(lens)
    padded = eng._prefill_padded(rows)
    before = eng.counters.prefill_tokens
    packed = eng._prefill_packed(rows)
    # the repeated sequences are prefilled once
    assert eng.counters.prefill_tokens - before == sum(len(s) for s in {tuple(t.prompt_ids + t.response_ids)
                                                                       for t in rows})
    assert torch.allclose(packed.logits, padded.logits, atol=1e-5)
    assert torch.equal(packed.mask, padded.mask) and torch.equal(packed.last_pos, padded.last_pos)
    keep = padded.mask.bool()[:, None, :, None]
    for a, b in zip(packed.cache.layers, padded.cache.layers, strict=True):
        assert torch.allclose(a.keys * keep, b.keys * keep, atol=1e-5)
        assert torch.allclose(a.values * keep, b.values * keep, atol=1e-5)


def test_packed_prefill_samples_what_padded_prefill_samples(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, max_batch=4)
    out = {}
    for packed in (True, False):
        eng.packed_prefill = packed
        out[packed] = eng.generate(_ragged(tok), SamplingParams(max_new_tokens=15, greedy=True))
    assert [t.response_ids for t in out[True]] == [t.response_ids for t in out[False]]
    gaps = [abs(a - b) for x, y in zip(out[True], out[False], strict=True)
            for a, b in zip(x.logp_infer, y.logp_infer, strict=True)]
    assert max(gaps) < 1e-5


def test_packed_prefill_attention_is_per_document_in_every_band():
    # lengths sorted as the engine packs them: equal-length runs (a view) and ragged bands (padded)
    lens = [3, 3, 3, 7, 8, 9, 9, 20, 24, 25, 60]
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, sum(lens), 8), torch.randn(1, 2, sum(lens), 8), torch.randn(1, 2, sum(lens), 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = packed_attention._prefill_or_sdpa(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                               is_causal=True, scale=0.3, enable_gqa=True)
        assert torch.allclose(out[0, s:e], ref[0].transpose(0, 1), atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_growing_cache_samples_exactly_what_dynamic_cache_samples(tiny_model_dir, monkeypatch, dtype):
    """The engine's KV cache writes each step into spare room instead of concatenating: the same
    numbers, so the same tokens and log-probabilities to the last bit, refills and compactions
    included (max_batch 5 over 12 prompts)."""
    from transformers import DynamicCache

    def sample():
        eng, tok = _engine(tiny_model_dir, dtype=dtype, max_batch=5)
        trajs = eng.generate(_trajs(tok), SamplingParams(temperature=1.0, max_new_tokens=40), seed=11)
        return [(t.response_ids, t.logp_infer) for t in trajs]

    growing = sample()
    monkeypatch.setattr(inprocess, "GrowingCache", DynamicCache)
    assert sample() == growing
    assert sum(len(ids) for ids, _ in growing) > 200


def test_decode_bands_group_rows_longest_first_within_pad_ratio():
    # a row joins the band while the band's longest is at most 1.25 x its length: 100 <= 1.25 x 80,
    # 100 > 1.25 x 79; 40 <= 1.25 x 32 (the bound is inclusive)
    assert inprocess.decode_bands([100, 90, 80, 79, 40, 33, 32, 5]) == [(0, 3, 100), (3, 4, 79), (4, 7, 40),
                                                                         (7, 8, 5)]
    assert inprocess.decode_bands([7, 7, 7]) == [(0, 3, 7)]
    assert inprocess.decode_bands([]) == []


def test_banded_decoding_samples_what_full_width_decoding_samples(tiny_model_dir, monkeypatch):
    """Decoding attends band by band over the cache columns each band's longest row fills; on
    ragged rows with refills (max_batch 4 over 12), the same greedy tokens and log-probs as
    attending every row over the whole padded width. Every step's rows are longest first (the
    bands are taken, never the one-band fallback), and the cells read are counted."""
    eng, tok = _engine(tiny_model_dir, max_batch=4)
    banded_steps = []
    bands_of = inprocess.decode_bands
    monkeypatch.setattr(inprocess, "decode_bands", lambda lengths: banded_steps.append(lengths) or bands_of(lengths))
    banded = eng.generate(_ragged(tok), SamplingParams(max_new_tokens=15, greedy=True))
    steps, cells = eng.counters.decode_steps, eng.counters.decode_cells
    assert len(banded_steps) == steps and any(len(bands_of(ls)) > 1 for ls in banded_steps)
    assert cells == sum((e - s) * w for ls in banded_steps for s, e, w in bands_of(ls))
    assert cells < sum(len(ls) * max(ls) for ls in banded_steps)  # less than the padded width read

    monkeypatch.setattr(inprocess, "decode_bands", lambda lengths: [(0, len(lengths), max(lengths))])
    eng, _ = _engine(tiny_model_dir, max_batch=4)
    full = eng.generate(_ragged(tok), SamplingParams(max_new_tokens=15, greedy=True))
    assert [t.response_ids for t in banded] == [t.response_ids for t in full]
    gaps = [abs(a - b) for x, y in zip(banded, full, strict=True) for a, b in zip(x.logp_infer, y.logp_infer, strict=True)]
    assert max(gaps) < 1e-5
