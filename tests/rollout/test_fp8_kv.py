"""The in-process engine's FP8 KV cache (rollout.kv_cache_dtype, rollout.kv_scales): the format's round
trip, the calibrated scales against a plain transformers forward, what it does to the log-probs, and
the RL loop on it."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.rollout.fp8_kv import FORMATS, KVQuant, calibration_ids, dequantize, fp8_max, quantize
from rlrecipe.rollout.inprocess import InProcessEngine, cache_keyword
from rlrecipe.rollout.kv_cache import GrowingCache
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.ports import free_port

# bits of mantissa: a value in the normal range is within 2^-(m + 1) of itself, relatively
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _grid(fmt):
    """Every finite value of the format, from its 256 bit patterns (no arithmetic of ours)."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    return values[torch.isfinite(values)].unique()


@pytest.mark.parametrize("fmt", list(FORMATS.values()))
def test_quantize_is_the_nearest_value_of_the_format_and_saturates(fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=gen) * 30
    scale = 0.37
    q = quantize(x, scale, fmt)
    assert q.dtype == fmt
    assert torch.equal(q.view(torch.uint8), (x / scale).to(fmt).view(torch.uint8))  # torch's own cast, bit for bit
    grid = _grid(fmt)
    y = x / scale
    nearest_gap = (grid[None, :] - y[:, None]).abs().min(1).values
    assert torch.allclose((q.float() - y).abs(), nearest_gap)  # round to nearest (a tie either way)
    back = dequantize(q, scale, torch.float32)
    normal = y.abs() >= torch.finfo(fmt).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(MANTISSA[fmt] + 1)
    top = fp8_max(fmt)
    huge = quantize(torch.tensor([1e9, -1e9]), 1.0, fmt).float()
    assert huge.tolist() == [top, -top]  # saturated, not inf or NaN
    assert quantize(torch.tensor([1e-9]), 1.0, fmt).float().item() == 0.0  # below the subnormals: flushed


def _engine(model_dir, kv="auto", scales="unit", dtype="float32"):
    tok = load_tokenizer(model_dir)
    return InProcessEngine(model_dir, tok.eos_token_id, tok.pad_token_id, dtype=dtype, max_batch=8,
                           kv_cache_dtype=kv, kv_scales=scales), tok


def _trajs(tok, n=6):
    return [Trajectory(uid=str(i), prompt_ids=tok.encode(f"Add {i * 37} and {10**i}.")) for i in range(n)]


def test_the_cache_holds_fp8_bits_of_the_keys_a_plain_forward_computes(tiny_model_dir):
    eng, tok = _engine(tiny_model_dir, "fp8_e4m3")
    ids = torch.tensor([tok.encode("Add 12 and 30.")])
    cache = GrowingCache(eng.kv_quant)
    with torch.no_grad():
        eng.model(input_ids=ids, **{eng._cache_kw: cache}, use_cache=True)
        plain = DynamicCache()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model(input_ids=ids, **{cache_keyword(model): plain}, use_cache=True)
    for ours, theirs in zip(cache.layers, plain.layers, strict=True):
        assert ours.keys.dtype == torch.float8_e4m3fn
        assert torch.equal(ours.keys.view(torch.uint8), theirs.keys.to(torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(ours.values.view(torch.uint8), theirs.values.to(torch.float8_e4m3fn).view(torch.uint8))


def _independent_scales(model_dir, fmt=torch.float8_e4m3fn):
    """amax(|K|) / fp8_max per layer from a plain transformers forward of the calibration batch: K from
    its DynamicCache (after RoPE), V from a hook on each v_proj."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v_amax = {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o, n=n: v_amax.__setitem__(n, float(o.abs().amax()))) for n, layer in enumerate(model.model.layers)]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=calibration_ids(model.config.vocab_size), **{cache_keyword(model): cache}, use_cache=True)
    for h in hooks:
        h.remove()
    top = fp8_max(fmt)
    return [float(layer.keys.abs().amax()) / top for layer in cache.layers], [v_amax[n] / top for n in sorted(v_amax)]


def test_calibrated_scales_follow_every_push(tiny_model_dir, other_model_dir):
    eng, tok = _engine(tiny_model_dir, "fp8_e4m3", "calibrated")
    eng.generate(_trajs(tok, 2), SamplingParams(max_new_tokens=3), seed=0)
    k, v = _independent_scales(tiny_model_dir)
    assert eng.kv_quant.k_scales == pytest.approx(k, rel=1e-5) and eng.kv_quant.v_scales == pytest.approx(v, rel=1e-5)
    assert all(s != 1.0 for s in k + v)
    eng.update_weights_from_disk(other_model_dir, version=1)
    eng.generate(_trajs(tok, 2), SamplingParams(max_new_tokens=3), seed=0)
    k2, v2 = _independent_scales(other_model_dir)
    assert eng.kv_quant.k_scales == pytest.approx(k2, rel=1e-5) and eng.kv_quant.v_scales == pytest.approx(v2, rel=1e-5)
    assert k2 != pytest.approx(k, rel=1e-3)
    state = load_model(tiny_model_dir).state_dict()
    eng.update_weights_from_state(state, version=2)  # a tensor push: back to the first weights
    eng.prompt_logprobs(tok.encode("Add 1 and 2."))
    assert eng.kv_quant.k_scales == pytest.approx(k, rel=1e-5)


def _logp_gap(model_dir, tok, **kw):
    """Max |log-prob| gap of the engine's FP8 cache against the float32 cache, on the float32 cache's
    own greedy responses (each token scored by both engines with the same prefix)."""
    ref, _ = _engine(model_dir)
    trajs = ref.generate(_trajs(tok, 4), SamplingParams(max_new_tokens=16, greedy=True), seed=0)
    other, _ = _engine(model_dir, **kw)
    ours = _forced(other, trajs)
    return max(abs(a - b) for t, lps in zip(trajs, ours, strict=True) for a, b in zip(t.logp_infer, lps, strict=True))


def _forced(engine, trajs):
    """The engine's log-prob of each response token after decoding the tokens before it: the response
    is fed through decoding steps (not a prefill), so every step reads the cache."""
    out = []
    with torch.no_grad():
        for t in trajs:
            batch = engine._prefill([Trajectory(uid="f", prompt_ids=t.prompt_ids)])
            lps = []
            for tok_id in t.response_ids:
                lps.append(float(torch.log_softmax(batch.logits[0], -1)[tok_id]))
                batch = engine._step(torch.tensor([tok_id]), batch)
            out.append(lps)
    return out


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_log_probs_differ_from_the_float32_cache_a_little(tiny_model_dir, kv):
    tok = load_tokenizer(tiny_model_dir)
    gap = _logp_gap(tiny_model_dir, tok, kv=kv)
    assert 0 < gap < 0.05


def _rescaled_v(model_dir, out, c):
    """The model with v_proj x c and o_proj / c: the same function, its values c times larger."""
    model = load_model(model_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(c)
            layer.self_attn.v_proj.bias.mul_(c)
            layer.self_attn.o_proj.weight.div_(c)
    model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("c", [3e3, 1e-5])  # values beyond e4m3's 448; below its smallest subnormal 2^-9
def test_calibrated_scales_keep_what_unit_scales_saturate_or_flush(tiny_model_dir, tmp_path, c):
    model_dir = _rescaled_v(tiny_model_dir, tmp_path / "m", c)
    tok = load_tokenizer(model_dir)
    unit = _logp_gap(model_dir, tok, kv="fp8_e4m3", scales="unit")
    calibrated = _logp_gap(model_dir, tok, kv="fp8_e4m3", scales="calibrated")
    assert calibrated < 0.05 < unit
    assert calibrated == pytest.approx(_logp_gap(tiny_model_dir, tok, kv="fp8_e4m3", scales="calibrated"), abs=0.02)


def test_kv_settings_are_checked_by_the_engine(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_scales calibrated needs an FP8 kv_cache_dtype"):
        _engine(tiny_model_dir, "auto", "calibrated")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        KVQuant.of("int8", "unit")


def test_rl_trains_on_an_fp8_cache(tmp_path, tiny_model_dir, monkeypatch):
    calibrations = []
    calibrate = KVQuant.calibrate
    monkeypatch.setattr(KVQuant, "calibrate", lambda self, *a: calibrations.append(self.fmt) or calibrate(self, *a))
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.stages.rl import run_rl
    from tests.helpers import rl_recipe, write_tiny_data

    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=2, save_every=2)
    spec["rollout"].update(kv_cache_dtype="fp8_e4m3", kv_scales="calibrated")
    spec["eval"] = {}
    run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="fp8.yaml"))
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["tokens_trained"] >= 300 for r in rows)
    assert all(r["mismatch_abs_logp"] > 0 for r in rows)
    assert calibrations == [torch.float8_e4m3fn] * 2  # at the start, and after step 1's push


def test_sglang_gets_the_flag_from_the_field():
    from rlrecipe.recipe.systems import SGLangServer
    from rlrecipe.rollout.sglang.server import server_specs, sglang_launch_cmd

    cmd = sglang_launch_cmd("m", "h", 1, 0, SGLangServer(), "bfloat16", 0, kv_cache_dtype="fp8_e4m3")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert "--kv-cache-dtype" not in sglang_launch_cmd("m", "h", 1, 0, SGLangServer(), "bfloat16", 0)
    flagged = SGLangServer(extra_args=["--kv-cache-dtype=fp8_e4m3"])
    assert sum(a.startswith("--kv-cache-dtype") for a in sglang_launch_cmd(
        "m", "h", 1, 0, flagged, "bfloat16", 0, kv_cache_dtype="fp8_e4m3")) == 1
    spec, = server_specs("m", SGLangServer(), [0], dtype="float32", seed=0, kv_cache_dtype="fp8_e5m2",
                         template=["rlrecipe", "serve", "{model}", "--kv-cache-dtype", "{kv_cache_dtype}"])
    assert spec.cmd[-2:] == ["--kv-cache-dtype", "fp8_e5m2"]


def test_the_stand_in_serves_an_fp8_cache_with_unit_scales(tiny_model_dir):
    import urllib.request

    from rlrecipe.core.errors import UserError
    from tests.helpers import serving_in_thread

    with serving_in_thread(tiny_model_dir, kv_cache_dtype="fp8_e4m3") as (port, sched):
        assert sched.engine.kv_quant.fmt == torch.float8_e4m3fn and not sched.engine.kv_quant.calibrated
        info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30).read())
        assert info["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(UserError, match="--kv-cache-dtype 'fp8_e3m4'"):
        with serving_in_thread(tiny_model_dir, kv_cache_dtype="fp8_e3m4"):
            pass


@pytest.mark.slow
def test_rl_trains_on_an_fp8_cache_through_the_sglang_path(tmp_path, tiny_model_dir):
    """rollout.engine sglang with `rlrecipe serve` launched as the server: the field reaches the server
    through {kv_cache_dtype}, and its FP8 cache shows in the mismatch (the same float32 served from a
    float32 cache stays under 1e-4: tests/stages/test_rl.py's broadcast run)."""
    import os
    import subprocess
    import sys

    from tests.helpers import rl_recipe, write_recipe, write_tiny_data

    port = free_port()
    data = write_tiny_data(tmp_path / "data")
    spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=2, save_every=2, c3po={"enabled": False})
    spec["eval"] = {}
    spec["rollout"] = {"engine": "sglang", "dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "max_new_tokens": 40,
                       "sglang": {"base_port": port, "startup_timeout_s": 120, "launch_cmd": [
                           "rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype",
                           "{dtype}", "--kv-cache-dtype", "{kv_cache_dtype}"]}}
    path = write_recipe(tmp_path / "rl.yaml", spec)
    subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rl", str(path)], check=True, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    run = tmp_path / "runs" / "rl"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["mismatch_abs_logp"] > 1e-4 for r in rows), [r["mismatch_abs_logp"] for r in rows]
    assert "KV cache fp8_e4m3 with scales 1.0" in (run / "sglang_server_0.log").read_text()
