"""The SGLang client under trainer.lora, against `rlrecipe serve --enable-lora`: each push loads the
adapter under a new name on every server, every /generate and the probe name it, the previous one is
unloaded, and a server that answers 200 but does not serve the new adapter is stopped at the push."""

from __future__ import annotations

import pytest
import torch

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.systems import LoraSection, SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.lora import launch_args
from rlrecipe.rollout.sglang.server import server_specs
from rlrecipe.rollout.weights.adapter import Adapter
from rlrecipe.rollout.weights.check import WeightMismatch
from rlrecipe.rollout.weights.probe import Scores
from rlrecipe.rollout.weights.transport import WeightTransport, for_lora, weight_transport
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.helpers import serving_in_thread
from tests.serve.test_serve_lora import peft_adapter, peft_logprobs

PROBE = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]


def test_lora_decides_the_transport_and_refuses_what_cannot_carry_an_adapter():
    assert weight_transport("sglang", SGLangServer(weight_sync="tensor"), lora=True) is WeightTransport.LORA_TENSOR
    assert weight_transport("sglang", SGLangServer(), lora=True) is WeightTransport.LORA_DISK
    assert weight_transport("inprocess", SGLangServer(), lora=True) is WeightTransport.IN_MEMORY
    assert for_lora(WeightTransport.LORA_TENSOR) is WeightTransport.LORA_TENSOR
    for sync in ("distributed", "ipc"):
        with pytest.raises(UserError, match=f"trainer.lora with rollout.sglang.weight_sync {sync}"):
            weight_transport("sglang", SGLangServer(weight_sync=sync), lora=True)


def test_launched_servers_get_the_lora_flags_and_a_template_its_placeholder():
    section = LoraSection(rank=8)
    assert launch_args(section) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2",
                                    "--lora-target-modules", "all"]
    assert launch_args(LoraSection(rank=4, target_modules=["q_proj", "v_proj"]))[-3:] == [
        "--lora-target-modules", "q_proj", "v_proj"]
    assert launch_args(LoraSection()) == []
    spec, = server_specs("m", SGLangServer(), [0], dtype="float32", seed=0, lora_args=launch_args(section))
    assert spec.cmd[spec.cmd.index("--enable-lora"):][:3] == ["--enable-lora", "--max-lora-rank", "8"]
    spec, = server_specs("m", SGLangServer(), [0], dtype="float32", seed=0, lora_args=launch_args(section),
                         template=["serve.sh", "{model}", "{lora_args}", "--x"])
    assert spec.cmd == ["serve.sh", "m", *launch_args(section), "--x"]
    spec, = server_specs("m", SGLangServer(), [0], dtype="float32", seed=0, template=["serve.sh", "{lora_args}"])
    assert spec.cmd == ["serve.sh"]


def scores(version: int, model) -> Scores:
    return Scores(version, PROBE, [peft_logprobs(model, s) for s in PROBE])


@pytest.fixture
def lora_engine(tiny_model_dir):
    with serving_in_thread(tiny_model_dir, chunk_tokens=4, enable_lora=True, max_lora_rank=8) as (port, sched):
        assert sched.ready.wait(120)
        tok = load_tokenizer(tiny_model_dir)
        eng = SGLangEngine([f"http://127.0.0.1:{port}"], eos_token_id=tok.eos_token_id, served_dtype="float32",
                           cfg=SGLangServer(weight_sync="tensor"), lora=True)
        base = peft_adapter(tiny_model_dir, seed=0)[2]
        with base.disable_adapter():
            eng.expect_logprobs(scores(0, base))  # the servers start from the base
        yield eng, sched
        eng.close()


def test_each_push_loads_a_new_adapter_named_by_every_generate_and_unloads_the_old(lora_engine, tiny_model_dir,
                                                                                  tmp_path):
    eng, sched = lora_engine
    assert eng.transport is WeightTransport.LORA_TENSOR
    names = []
    for version, seed in ((1, 1), (2, 2), (3, 3)):
        config, tensors, model = peft_adapter(tiny_model_dir, seed=seed)
        eng.expect_logprobs(scores(version, model))
        adapter = Adapter(config, tensors)
        if version == 2:
            adapter = adapter.write(tmp_path / "v2")  # weight_sync disk: the server reads the directory
        eng.update_adapter(adapter, version)
        names.append(eng.fleet.adapter)
        assert names[-1] == f"{eng.fleet.adapter_prefix}-v{version}"
        # the adapter just replaced stays for requests still in flight; the one before it is unloaded now
        assert sched.adapters.order == names[-2:]
        assert sched.adapters.paths[names[-1]] == (str(tmp_path / "v2") if version == 2 else "__tensor__")
        # a rollout is sampled under the adapter: its log-probs are the merged model's
        t = Trajectory(uid="a", prompt_ids=PROBE[0])
        eng.generate([t], SamplingParams(temperature=1.0, max_new_tokens=6))
        with torch.no_grad():
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        want = logp[len(PROBE[0]) - 1:].gather(-1, ids[0, len(PROBE[0]):, None])[:, 0]
        assert torch.allclose(torch.tensor(t.logp_infer), want, atol=1e-5), (t.logp_infer, want)
        assert set(t.versions) == {version}
    assert sched.weight_version == "default"  # the base never moved


def test_two_runs_on_the_same_server_keep_their_own_adapters(lora_engine, tiny_model_dir):
    """A second run attached to the same server pushes its version 1 too: each keeps its own adapter,
    and neither unloads what the other loaded."""
    eng, sched = lora_engine
    other = SGLangEngine(eng.fleet.urls, eos_token_id=eng.eos, served_dtype="float32",
                         cfg=SGLangServer(weight_sync="tensor"), lora=True)
    try:
        assert other.fleet.adapter_prefix != eng.fleet.adapter_prefix
        config, tensors, model = peft_adapter(tiny_model_dir, seed=1)
        eng.expect_logprobs(scores(1, model))
        eng.update_adapter(Adapter(config, tensors), 1)
        mine = eng.fleet.adapter
        config2, tensors2, model2 = peft_adapter(tiny_model_dir, seed=2)
        for version in (1, 2, 3):  # the other run's pushes, its own unloads among them
            other.expect_logprobs(scores(version, model2))
            other.update_adapter(Adapter(config2, tensors2), version)
        assert mine in sched.adapters.order  # still loaded, still this run's weights:
        eng.expect_logprobs(scores(1, model))
        eng.weights.verify_adapter(1)  # the probe under it gives this run's log-probs, not the other's
    finally:
        other.close()


def test_an_unload_that_fails_on_a_lost_server_leaves_it_out_like_a_push(lora_engine, tiny_model_dir, monkeypatch):
    from rlrecipe.rollout.sglang import lora, weights

    eng, _ = lora_engine
    for version in (1, 2):
        config, tensors, model = peft_adapter(tiny_model_dir, seed=version)
        eng.expect_logprobs(scores(version, model))
        eng.update_adapter(Adapter(config, tensors), version)
    failed = []

    def lost(fleet, i, name):
        raise UserError(f"SGLang server {fleet.urls[i]} unreachable on /unload_lora_adapter")

    monkeypatch.setattr(lora, "unload", lost)
    monkeypatch.setattr(weights, "failed_push", lambda fleet, i, err: failed.append((i, str(err))))
    config, tensors, model = peft_adapter(tiny_model_dir, seed=3)
    eng.expect_logprobs(scores(3, model))
    eng.update_adapter(Adapter(config, tensors), 3)  # the unload of version 1's adapter fails: handed on
    assert failed == [(0, f"SGLang server {eng.fleet.urls[0]} unreachable on /unload_lora_adapter")]


def test_a_server_that_answers_200_but_keeps_the_old_adapter_is_stopped(lora_engine, tiny_model_dir):
    eng, sched = lora_engine
    config, tensors, model = peft_adapter(tiny_model_dir, seed=1)
    eng.expect_logprobs(scores(1, model))
    eng.update_adapter(Adapter(config, tensors), 1)
    first = eng.fleet.adapter
    config2, tensors2, model2 = peft_adapter(tiny_model_dir, seed=2)
    eng.expect_logprobs(scores(2, model2))
    real_load = sched.adapters.load

    def stale(name, config, tensors, path):  # answers 200, serves the old adapter under the new name
        sched.adapters.deltas[name], sched.adapters.paths[name] = sched.adapters.deltas[first], path
        sched.adapters.order.append(name)
        return sched.adapters._result(True)

    sched.adapters.load = stale
    with pytest.raises(WeightMismatch, match="still serves the weights of version 1"):
        eng.update_adapter(Adapter(config2, tensors2), 2)

    def ignored(name, config, tensors, path):  # answers 200, loads nothing
        return sched.adapters._result(True)

    sched.adapters.load = ignored
    eng.expect_logprobs(scores(3, model2))
    with pytest.raises(WeightMismatch, match=f"refuses the probe under adapter {eng.fleet.adapter_prefix}-v3 .*never been loaded"):
        eng.update_adapter(Adapter(config2, tensors2), 3)
    sched.adapters.load = real_load


def test_a_colocated_lora_engine_releases_and_resumes_the_kv_cache_alone(lora_engine, monkeypatch):
    eng, _ = lora_engine
    sent = []
    monkeypatch.setattr("rlrecipe.rollout.sglang.engine.occupy", lambda fleet, path, tags: sent.append((path, tags)))
    eng.release_memory()
    eng.resume_memory(["weights"])  # what a colocated push asks first: the base never left
    eng.resume_memory(["kv_cache", "cuda_graph"])
    assert sent == [("/release_memory_occupation", ["kv_cache", "cuda_graph"]),
                    ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]


class _Trainer:
    """What WeightsOut asks of a LoRA trainer: its adapter, and the probe's log-probs."""

    is_lora, temperature = True, 1.0

    def __init__(self):
        self.step = 0

    def adapter_state(self):
        b = torch.full((4, 2), float(self.step))
        return {"r": 2, "lora_alpha": 4}, {"base_model.model.l.lora_A.weight": torch.ones(2, 4),
                                           "base_model.model.l.lora_B.weight": b}

    def compute_logprobs(self, samples):
        return [(torch.zeros(len(s.input_ids) - 1), None) for s in samples]


class _Engine:
    def __init__(self):
        self.pushed = []

    def expect_logprobs(self, scores):
        pass

    def update_adapter(self, adapter, version, verify=True):
        self.pushed.append((version, adapter))


def test_weights_out_pushes_the_adapter_whatever_transport_was_decided_without_lora(tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from rlrecipe.rl.schedule import WeightsOut

    tok, trainer, engine = load_tokenizer(tiny_model_dir), _Trainer(), _Engine()
    run = SimpleNamespace(dir=tmp_path)
    out = WeightsOut(trainer, run, tok, WeightTransport.DISK, 0, bucket_bytes=1 << 20)
    assert out.transport is WeightTransport.LORA_DISK
    out.attach(engine)
    for version in (1, 2):
        trainer.step = version
        out.push(version)
    (v1, a1), (v2, a2) = engine.pushed
    assert (v1, v2) == (1, 2) and a2.path == tmp_path / "weights_for_rollout" / "adapter-v0000002"
    assert sorted(p.name for p in a2.path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not a1.path.exists()  # the push before it, no longer served, is deleted
    # asynchronous: a copy frozen now, installed later, unmoved by the steps between
    frozen = out.freeze(3)
    trainer.step = 9
    out.install(frozen, 3)
    assert engine.pushed[-1][0] == 3 and float(engine.pushed[-1][1].tensors["base_model.model.l.lora_B.weight"][0, 0]) == 2.0
    tensor = WeightsOut(trainer, run, tok, WeightTransport.TENSOR, 0, bucket_bytes=1 << 20)
    tensor.attach(engine)
    tensor.push(4)
    assert tensor.transport is WeightTransport.LORA_TENSOR and engine.pushed[-1][1].path is None
    with pytest.raises(UserError, match="weight_sync distributed"):
        WeightsOut(trainer, run, tok, WeightTransport.BROADCAST, 0, bucket_bytes=1 << 20)
