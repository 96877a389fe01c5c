"""trainer.lora on the torch engine and through `rlrecipe rl` (rlrecipe/train/lora.py): the base stays
frozen bit for bit, what leaves the trainer is the base with the adapter merged (checked against
PEFT's own merge) or the adapter in PEFT's format, and a killed LoRA run resumes identically."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from rlrecipe.algo.columns import TokenColumns
from rlrecipe.core.errors import UserError
from rlrecipe.modeling import load_model
from rlrecipe.recipe.systems import LoraSection, TrainerSection
from rlrecipe.train import lora
from rlrecipe.train.base import TrainSample
from rlrecipe.train.torch_engine import TorchTrainEngine
from tests.helpers import beside, kill_once_checkpointed, rl_recipe, write_recipe, write_tiny_data

TRAINER = dict(lr=1e-2, max_tokens_per_microbatch=64)


def _samples(seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = [TrainSample(torch.randint(5, 200, (n,), generator=g).tolist(), 4) for n in (20, 14, 9)]
    tokens = sum(s.num_response for s in out)
    for s in out:
        s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / tokens))
    return out


def _nll(logp, cols):
    return -(logp * cols.scale).sum(), {}


def _logprobs(model, samples) -> list[torch.Tensor]:
    """Response-token log-probs of a plain HF model, one sequence at a time (no packing)."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            logp = model(ids).logits[0].float().log_softmax(-1)
            out.append(logp[s.start - 1:-1].gather(1, ids[0, s.start:, None])[:, 0])
    return out


def _engine(model_dir, rank=4, **extra) -> TorchTrainEngine:
    return TorchTrainEngine(model_dir, TrainerSection(**TRAINER, lora={"rank": rank, "alpha": 8}, **extra), 10)


def test_the_merge_equals_peft_merging_into_a_copy_and_leaves_the_base_alone(tiny_model_dir):
    model = lora.wrap(load_model(tiny_model_dir, "float32"), LoraSection(rank=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B starts at 0: give the adapter something to merge
    before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    merged = lora.merged_state(model)
    by_peft = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(by_peft) == set(load_model(tiny_model_dir, "float32").state_dict())
    for name, tensor in by_peft.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.get_base_model().state_dict().items())
    # alpha / r = 2 scales B A; every linear of the blocks is adapted ("all-linear"), the LM head not
    q = "model.layers.0.self_attn.q_proj"
    layer = model.get_submodule("base_model.model." + q)
    expected = before[q + ".base_layer.weight"] + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged[q + ".weight"], expected, rtol=0, atol=1e-6)
    assert torch.equal(merged["lm_head.weight"], before["lm_head.weight"])
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora.adapter_tensors(model)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_bfloat16_base_keeps_a_small_update_through_the_merge_and_the_export(tiny_model_dir, tmp_path):
    """W + (alpha / r) B A summed in bfloat16 rounds to W's 8 bits: an update of 0.1% of W mostly vanished
    (about 30% of it off). Summed in float32 and exported in float32, what was trained survives."""
    from safetensors.torch import load_file

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(**TRAINER, lora={"rank": 4, "alpha": 8}), 10, dtype="bfloat16")
    q = "model.layers.0.self_attn.q_proj"
    layer = eng.model.get_submodule("base_model.model." + q)
    base, a, b = layer.get_base_layer().weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert base.dtype == torch.bfloat16
    with torch.no_grad():
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(0)))
        b.mul_(1e-3 * base.float().norm() / (2.0 * b.float() @ a.float()).norm())  # alpha / r = 2
    update = 2.0 * b.detach().float() @ a.detach().float()

    def kept(weight):  # how far what the weight carries on top of the base is from the update
        return float(((weight.float() - base.float()) - update).norm() / update.norm())

    assert kept(lora.merged_state(eng.model)[q + ".weight"]) < 0.01
    assert kept(dict(lora.merged_layer(layer))["weight"]) < 0.01  # ZeRO-3's merge, layer by layer
    exported = load_file(str(eng.export_hf(tmp_path / "final") / "model.safetensors"))
    assert exported[q + ".weight"].dtype == torch.float32 and kept(exported[q + ".weight"]) < 0.01
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "float32"
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert torch.equal(exported["model.norm.weight"], eng.model.get_base_model().model.norm.weight.float())


def test_only_the_adapter_trains_and_the_merged_export_is_the_policy_the_trainer_scores(tiny_model_dir, tmp_path):
    eng = _engine(tiny_model_dir)
    # what the optimizer holds, not what has gradients: AdamW skips a parameter without one, so a
    # frozen weight handed to it would stay unchanged as well
    held = [p for group in eng.optimizer.param_groups for p in group["params"]]
    lora_params = {id(p) for n, p in eng.model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert all(id(p) in lora_params for p in held)
    assert len({id(p) for p in held}) == len(lora_params) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    adapter = sum(p.numel() for p in held)
    # rank 4 on every linear of 2 layers: (in + out) x 4 each; hidden 64, intermediate 128, kv 2 x 16
    per_layer = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 2 + (128 + 64))
    assert adapter == 2 * per_layer
    base = {k: v.clone() for k, v in eng.model.get_base_model().state_dict().items() if ".lora_" not in k}
    for step in range(3):
        assert eng.train_step(_samples(step), _nll).skipped is False
    assert all(torch.equal(base[k], v) for k, v in eng.model.get_base_model().state_dict().items() if k in base)
    export = eng.export_hf(tmp_path / "export")
    assert (export / "adapter" / "adapter_config.json").exists()
    served = load_model(export, "float32")
    trainer_logp = [lp for lp, _ in eng.compute_logprobs(_samples(9))]
    for ours, theirs in zip(trainer_logp, _logprobs(served, _samples(9)), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert max((a - b).abs().max() for a, b in zip(trainer_logp, _logprobs(load_model(tiny_model_dir, "float32"),
                                                                            _samples(9)), strict=True)) > 1e-3
    # the reference policy: the base with the adapter off, the same numbers as the base model itself
    with eng.adapter_off():
        off = [lp for lp, _ in eng.compute_logprobs(_samples(9))]
    for ours, theirs in zip(off, _logprobs(load_model(tiny_model_dir, "float32"), _samples(9)), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    config, tensors = eng.adapter_state()
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert sum(t.numel() for t in tensors.values()) == adapter
    json.dumps(config)  # what a push sends as config_dict


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model_dir, tmp_path):
    eng = _engine(tiny_model_dir)
    eng.train_step(_samples(0), _nll)
    eng.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["adapter", "trainer_state.pt"]
    then = eng.train_step(_samples(1), _nll)
    again = _engine(tiny_model_dir)
    again.load(tmp_path / "ckpt")
    now = again.train_step(_samples(1), _nll)
    assert (now.loss, now.grad_norm) == (then.loss, then.grad_norm)
    for name, t in eng.adapter_state()[1].items():
        assert torch.equal(again.adapter_state()[1][name], t), name
    other = _engine(tiny_model_dir, rank=8)
    with pytest.raises(UserError, match="not this recipe's adapter"):
        other.load(tmp_path / "ckpt")


def test_the_adapter_starts_the_same_whatever_the_process_rng_holds(tiny_model_dir):
    torch.manual_seed(1)
    a = _engine(tiny_model_dir).adapter_state()[1]
    torch.manual_seed(2)
    b = _engine(tiny_model_dir).adapter_state()[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.any(v) for k, v in a.items() if "lora_B" in k)  # the policy starts unchanged


def test_a_target_the_model_lacks_is_refused_in_one_line(tiny_model_dir):
    with pytest.raises(UserError, match=r"trainer.lora.target_modules: qkv_proj not among the model's linear "
                                        r"layers \(down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj"):
        TorchTrainEngine(tiny_model_dir, TrainerSection(**TRAINER, lora={"rank": 4, "target_modules":
                                                                          ["q_proj", "qkv_proj"]}), 10)


@pytest.mark.slow
def test_lora_rl_trains_exports_merged_and_resumes_after_a_kill_identically(tmp_path, tiny_model_dir):
    data = write_tiny_data(tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlrecipe.cli.app", "rl"]

    def spec(root):
        recipe = rl_recipe(root, data, str(tiny_model_dir), kl_coef=0.01)
        recipe["trainer"] = {**recipe["trainer"], "lr": 1e-2, "lora": {"rank": 8, "alpha": 16}}
        recipe["eval"]["benchmarks"] = []
        root.mkdir(parents=True, exist_ok=True)
        return write_recipe(root / "rl.yaml", recipe)

    def rows(run):
        timing = {"rollout_s", "train_s", "gen_tokens_per_s", "grade_s", "step_wall_s"}
        return [{k: v for k, v in json.loads(ln).items() if k not in timing and not k.startswith("time/")}
                for ln in (run / "metrics.jsonl").read_text().splitlines()]

    def run_rl(*args):
        out = subprocess.run([*cmd, *args], env=env, timeout=600, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

    other = tmp_path / "b" / "runs" / "rl"
    recipe = spec(tmp_path / "b")
    with beside([*cmd, str(spec(tmp_path / "a"))], tmp_path / "a.log", env=env):  # the uninterrupted reference
        kill_once_checkpointed([*cmd, str(recipe)], env, other / "checkpoints" / "step_0000002")
        run_rl(str(recipe), "--resume")
    run = tmp_path / "a" / "runs" / "rl"
    reference = rows(run)
    assert len(reference) == 4 and all(r["kl_ref"] >= 0 for r in reference) and reference[-1]["kl_ref"] > 0
    kept = {p.name for p in (sorted((run / "checkpoints").glob("step_*"))[-1] / "trainer").iterdir()}
    assert "adapter" in kept and "model" not in kept, kept  # the base is never written again
    final = run / "final"
    merged = load_model(final, "float32").state_dict()
    base = load_model(tiny_model_dir, "float32").state_dict()
    assert set(merged) == set(base) and (final / "adapter" / "adapter_model.safetensors").exists()
    assert not torch.equal(merged["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert rows(other) == reference


def test_a_colocated_hand_over_leaves_the_frozen_base_on_the_device(tiny_model_dir, monkeypatch):
    """Colocated with LoRA the base never moves: the hand-over offloads the adapter's optimizer only."""
    eng = _engine(tiny_model_dir)
    eng.train_step(_samples(0), _nll)
    moves = []
    monkeypatch.setattr(eng.model, "to", lambda *a, **k: moves.append(a))
    eng.offload_states("weights")
    assert moves == []
    full = TorchTrainEngine(tiny_model_dir, TrainerSection(**TRAINER), 10)
    monkeypatch.setattr(full.model, "to", lambda *a, **k: moves.append(a))
    full.offload_states("weights")
    assert moves == [(torch.device("cpu"),)]


@pytest.mark.parametrize("sync", ["distributed", "ipc"])
def test_lora_rl_with_a_push_that_cannot_carry_an_adapter_stops_before_anything_loads(sync, tmp_path,
                                                                                      tiny_model_dir):
    """A recipe fit may still rewrite (it picks the push) loads; the run refuses it in one line first."""
    data = write_tiny_data(tmp_path / "data")
    recipe = rl_recipe(tmp_path, data, str(tiny_model_dir))
    recipe["trainer"]["lora"] = {"rank": 4}
    recipe["rollout"] = {**recipe["rollout"], "engine": "sglang", "urls": ["http://127.0.0.1:9"],
                         "sglang": {"weight_sync": sync}}
    out = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rl", str(write_recipe(tmp_path / "r.yaml", recipe))],
                         capture_output=True, text=True, timeout=300)
    said = out.stdout + out.stderr
    assert out.returncode != 0
    assert (f"trainer.lora with rollout.sglang.weight_sync {sync}: SGLang takes an adapter only by "
            "/load_lora_adapter_from_tensors or from disk") in " ".join(said.split())
    assert not (tmp_path / "runs" / "rl" / "checkpoints").exists() or not any((tmp_path / "runs" / "rl" /
                                                                              "checkpoints").iterdir())
