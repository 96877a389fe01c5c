"""DeepSpeed engine (ZeRO-2 / ZeRO-3) in real processes: 2 ranks on CPU over gloo, via torchrun.

The same 3 steps run on the torch engine in this process (the reference) and on the DeepSpeed
engine in 2 processes; losses, gradient norms, log-probs and the exported weights must agree.
The batches are chosen so the ranks get uneven work: step 2 gives the ranks different numbers of
micro-batches and step 3 has a single sample, so one rank trains on padding only. A second
launch loads the step-2 checkpoint in fresh processes and must repeat step 3 exactly.

This file is also the worker: torchrun runs it with a JSON spec as its argument.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_bounded

pytestmark = pytest.mark.slow  # subprocess-heavy: `make test-fast` leaves it out

# Two ranks run on CPU over gloo, or on two GPUs over nccl; a machine with one GPU has neither
# (each rank takes the GPU of its local rank, and nccl refuses two ranks on one device).
two_ranks = pytest.mark.skipif(0 < torch.cuda.device_count() < 2,
                               reason="two ranks need two GPUs where CUDA is visible (nccl)")

TRAINER = dict(lr=1e-2, lr_schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1, adam_betas=(0.9, 0.95),
               adam_eps=1e-8, grad_clip=1.0, max_tokens_per_microbatch=40)
TOTAL_STEPS = 4
STEPS = 3
# Tiny parameters would stay whole under ZeRO-3 (persistence threshold); partition every one.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
LOSS_RTOL = 1e-4  # DeepSpeed vs torch engine, float32; observed: loss 3e-7, grad norm 3e-6 (relative)
WEIGHT_ATOL = 5e-4  # after 3 AdamW steps at lr 1e-2 (one step moves a weight by ~1e-2); observed 6e-5


def batch(step: int) -> list:
    """Deterministic uneven batches: (lengths, prompt length) per step."""
    from rlrecipe.algo.columns import TokenColumns
    from rlrecipe.train.base import TrainSample

    lengths = [[30, 12, 25, 8, 17], [39, 38, 5], [21]][step]
    g = torch.Generator().manual_seed(100 + step)
    samples = [TrainSample(torch.randint(5, 200, (n,), generator=g).tolist(), 3) for n in lengths]
    n_tok = sum(s.num_response for s in samples)
    for s in samples:
        s.columns = TokenColumns(scale=torch.full((s.num_response,), 1.0 / n_tok))
    return samples


def loss_fn(logp, f):
    return -(logp * f.scale).sum(), {"nll_sum": float(-logp.detach().sum()), "tokens": float(len(logp))}


def nan_loss(logp, f):
    return (logp * f.scale).sum() * float("nan"), {}


# -- the worker (runs under torchrun) -------------------------------------------------------------
def worker(spec: dict) -> None:
    import torch.distributed as dist

    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.deepspeed_engine import DeepSpeedTrainEngine

    cfg = TrainerSection(engine="deepspeed", zero_stage=spec["stage"], **TRAINER, **spec.get("trainer", {}))
    eng = DeepSpeedTrainEngine(spec["model"], cfg, TOTAL_STEPS, ds_config_overrides=PARTITION_ALL)
    from transformers.integrations import is_deepspeed_zero3_enabled

    # partitioned loading is on for the trainer's model only: a rollout model loaded later is whole
    out: dict = {"world": eng.world, "steps": [], "partitioned_load": eng.partitioned_load,
                 "zero3_loading_left_on": is_deepspeed_zero3_enabled()}
    if spec.get("resume"):
        from rlrecipe.core.errors import UserError

        try:
            eng.load(spec["resume"])
        except UserError as err:  # a checkpoint refused: its one line is the result
            Path(spec["out"]).write_text(json.dumps({"refused": str(err)}))
            return
    else:
        out["logp0"] = [lp.tolist() for lp, _ in eng.compute_logprobs(batch(0))]
    out["start"] = eng.steps_done
    for step in range(eng.steps_done, STEPS):
        samples = batch(step)
        counts: list = [None] * eng.world
        dist.all_gather_object(counts, len(eng.microbatches_of(samples, eng.shard(samples))))
        stats = eng.train_step(samples, loss_fn)
        out["steps"].append({"step": step, "microbatches_per_rank": counts, **stats.additive()})
        if spec.get("colocated"):  # a colocated step's hand-over: nothing it does may change the training
            eng.offload_states("optimizer")
            pushed = eng.rollout_state()  # the push reads the weights between the two offloads
            out.setdefault("pushed_sums", []).append(sum(float(v.double().sum()) for v in pushed.values()))
            # the push by handle reads them on every rank instead, tied ones once (gathered under ZeRO-3)
            mine = {name: float(t.double().sum()) for name, t in eng.full_weights()}
            every: list = [None] * eng.world
            dist.all_gather_object(every, mine)
            out.setdefault("full_weights", []).append(every)
            out.setdefault("rollout_state", []).append({k: float(v.double().sum()) for k, v in pushed.items()})
            out["tied"] = bool(eng.engine.module.config.tie_word_embeddings)
            eng.offload_states("weights")
            eng.reload_states()
        if step + 1 == spec.get("save_at"):
            eng.save(spec["ckpt"])
    eng.export_hf(spec["export"])
    out["rand_after"] = torch.rand(1).item()  # the RNG state is part of the checkpoint
    before = eng.compute_logprobs(batch(0))
    out["nan_step"] = eng.train_step(batch(0), nan_loss).additive()
    after = eng.compute_logprobs(batch(0))
    out["nan_step_kept_weights"] = all(torch.equal(a[0], b[0]) for a, b in zip(before, after, strict=True))
    if eng.rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    # both ranks done before either tears its group down: a rank that exits while the other is still
    # inside gloo made the process abort now and then ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


# -- helpers for the tests ------------------------------------------------------------------------
def torchrun(spec: dict, nproc: int = 2) -> dict:
    """This file as the worker, under torchrun with `nproc` processes (nproc 0: plain python, no torchrun)."""
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nnodes=1", f"--nproc_per_node={nproc}"]
    run_bounded([*launcher, __file__, json.dumps(spec)])
    return json.loads(Path(spec["out"]).read_text())


def torch_reference(model_dir: Path, **trainer) -> dict:
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine(model_dir, TrainerSection(engine="torch", **TRAINER, **trainer), TOTAL_STEPS)
    ref = {"logp0": [lp for lp, _ in eng.compute_logprobs(batch(0))], "steps": []}
    for step in range(STEPS):
        ref["steps"].append(eng.train_step(batch(step), loss_fn).additive())
    ref["state"] = {k: v.detach().clone() for k, v in eng.rollout_state().items()}
    ref["nan_step"] = eng.train_step(batch(0), nan_loss).additive()
    return ref


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.state_dict()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return torch_reference(tiny_model_dir)


@two_ranks
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_match_torch_engine_and_resume(stage, tiny_model_dir, reference, tmp_path):
    spec = {"model": str(tiny_model_dir), "stage": stage, "save_at": 2, "ckpt": str(tmp_path / "ckpt"),
            "export": str(tmp_path / "export"), "out": str(tmp_path / "full.json")}
    full = torchrun(spec)
    assert full["world"] == 2
    # ZeRO-3 loads the weights already partitioned (no rank builds the whole model first)
    assert full["partitioned_load"] == (stage == 3) and not full["zero3_loading_left_on"]

    # uneven shards: different micro-batch counts at step 2, one rank with no samples at step 3
    counts = [s["microbatches_per_rank"] for s in full["steps"]]
    assert counts[1][0] != counts[1][1] and 0 in counts[2], counts

    for i, (ds, ref) in enumerate(zip(full["steps"], reference["steps"], strict=True)):
        assert ds["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), f"step {i + 1} loss"
        assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL), f"step {i + 1} grad norm"
        assert ds["lr"] == pytest.approx(ref["lr"], rel=1e-9)
        assert ds["nll_sum"] == pytest.approx(ref["nll_sum"], rel=LOSS_RTOL)
        assert ds["tokens"] == ref["tokens"]
        assert ds["skipped"] == 0.0
    # a NaN loss skips the update on every rank; the schedule still advances, as in the torch engine
    assert full["nan_step"]["skipped"] == reference["nan_step"]["skipped"] == 1.0
    assert full["nan_step"]["lr"] == pytest.approx(reference["nan_step"]["lr"], rel=1e-9)
    assert full["nan_step_kept_weights"]
    for ds, ref in zip(full["logp0"], reference["logp0"], strict=True):
        torch.testing.assert_close(torch.tensor(ds), ref, rtol=0, atol=1e-5)

    # the exported model loads with from_pretrained and matches the torch engine's weights
    exported = load_weights(tmp_path / "export")
    for name, ref_w in reference["state"].items():
        torch.testing.assert_close(exported[name], ref_w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{n}: {m}")
    # so does the HF copy inside the checkpoint
    assert set(load_weights(tmp_path / "ckpt" / "model")) == set(exported)

    # fresh processes resume from the step-2 checkpoint and repeat step 3 exactly
    resumed = torchrun({**spec, "resume": spec["ckpt"], "save_at": None, "export": str(tmp_path / "export_resumed"),
                        "out": str(tmp_path / "resumed.json")})
    assert resumed["start"] == 2 and len(resumed["steps"]) == 1
    again, first = resumed["steps"][0], full["steps"][2]
    assert again["loss"] == pytest.approx(first["loss"], rel=1e-6)
    assert again["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-6)
    assert again["lr"] == pytest.approx(first["lr"], rel=1e-12)
    assert resumed["rand_after"] == full["rand_after"]
    resumed_w = load_weights(tmp_path / "export_resumed")
    for name, w in exported.items():
        torch.testing.assert_close(resumed_w[name], w, rtol=0, atol=1e-6)


def test_single_process_without_launcher(tiny_model_dir, reference, tmp_path):
    """nproc 1: no torchrun; the engine starts a 1-process group itself (ZeRO-3 with everything local)."""
    spec = {"model": str(tiny_model_dir), "stage": 3, "export": str(tmp_path / "export"), "out": str(tmp_path / "o.json")}
    out = torchrun(spec, nproc=0)
    assert out["world"] == 1
    for ds, ref in zip(out["steps"], reference["steps"], strict=True):
        assert ds["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL)


@two_ranks
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_and_reload_between_steps_change_nothing(stage, tiny_model_dir, reference, tmp_path):
    """The colocated hand-over (optimizer offloaded, weights read for the push, weights offloaded,
    all reloaded) between every two steps: the same steps as the torch engine without it."""
    spec = {"model": str(tiny_model_dir), "stage": stage, "colocated": True, "export": str(tmp_path / "export"),
            "out": str(tmp_path / "o.json")}
    out = torchrun(spec)
    for ds, ref in zip(out["steps"], reference["steps"], strict=True):
        assert ds["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL)
    assert len(out["pushed_sums"]) == STEPS and len(set(out["pushed_sums"])) == STEPS  # the weights moved
    for every, state in zip(out["full_weights"], out["rollout_state"], strict=True):
        assert every[0] == every[1]  # every rank holds the same full weights
        assert every[0] == {k: v for k, v in state.items() if not (out["tied"] and k == "lm_head.weight")}
    exported = load_weights(tmp_path / "export")
    for name, ref_w in reference["state"].items():
        torch.testing.assert_close(exported[name], ref_w, rtol=0, atol=WEIGHT_ATOL)


@two_ranks
def test_cli_sft_launches_two_ranks_and_resumes(tiny_model_dir, tmp_path):
    """`rlrecipe sft` with nproc 2 starts torchrun itself; rank 0 alone writes records; resume repeats a step."""
    rows = [{"id": f"r{i}", "prompt": f"Add {i} and {2 * i + 7}.",
             "response": f"{i}+{2 * i + 7}\n\\boxed{{{3 * i + 7}}}" + "x" * (i % 5 * 7)} for i in range(12)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.yaml").write_text(f"""run: {{name: ds-sft, output_dir: runs, seed: 1}}
model: {{path: {tiny_model_dir}}}
data: {{train: sft.jsonl, prompt_template: plain}}
sft: {{max_steps: 3, batch_size: 5, max_length: 128, save_every: 2}}
trainer: {{engine: deepspeed, zero_stage: 2, nproc: 2, lr: 1.0e-3, max_tokens_per_microbatch: 64}}
""")
    cli = [sys.executable, "-m", "rlrecipe.cli.app", "sft", "r.yaml"]
    log = run_bounded(cli, cwd=tmp_path)
    assert log.count("SFT: 12 examples") == 1  # only rank 0 prints
    run = tmp_path / "runs" / "ds-sft"
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # written once, by rank 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000003"
    shards = sorted(p.name for p in (ckpts / "step_0000002" / "deepspeed").rglob("*optim_states.pt"))
    assert len(shards) == 2, shards  # each rank wrote its optimizer shard
    assert not list(ckpts.glob("*.partial"))
    load_weights(run / "final")

    # as if killed after step 2: resume in new processes, step 3 again, same numbers
    shutil.rmtree(ckpts / "step_0000003")
    (ckpts / "latest").write_text("step_0000002")
    log = run_bounded([*cli, "--resume"], cwd=tmp_path)
    assert "resumed from" in log
    again = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in again] == [1, 2, 3]
    assert again[2]["loss"] == pytest.approx(metrics[2]["loss"], rel=1e-6)
    assert again[2]["grad_norm"] == pytest.approx(metrics[2]["grad_norm"], rel=1e-6)


@two_ranks
def test_cli_rl_on_two_ranks_matches_one_torch_process(tiny_model_dir, tmp_path):
    """Rank 0 rolls out and grades, both ranks train on its batch; numbers match the torch engine."""
    (tmp_path / "rl.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": f"From {100 + i} add {11 + i} until above {150 + i}.",
                    "answers": [str(100 + i + 2 * (11 + i))]}) + "\n" for i in range(16)))
    base = """run: {{name: {name}, output_dir: runs, seed: 2, init_from: {model}}}
data: {{train: rl.jsonl, prompt_template: plain}}
rl: {{steps: 2, prompts_per_step: 3, samples_per_prompt: 2, ppo_minibatches: 2, c3po: {{enabled: false}}}}
rollout: {{dtype: float32, max_new_tokens: 12, max_batch: 8}}
trainer: {{engine: {engine}, zero_stage: 2, nproc: {nproc}, lr: 1.0e-3, max_tokens_per_microbatch: 64}}
"""
    (tmp_path / "ds.yaml").write_text(base.format(name="ds-rl", model=tiny_model_dir, engine="deepspeed", nproc=2))
    (tmp_path / "pt.yaml").write_text(base.format(name="pt-rl", model=tiny_model_dir, engine="torch", nproc=1))
    log = run_bounded([sys.executable, "-m", "rlrecipe.cli.app", "rl", "ds.yaml"], cwd=tmp_path)
    assert log.count("RL done") == 1  # only rank 0 prints
    run_bounded([sys.executable, "-m", "rlrecipe.cli.app", "rl", "pt.yaml"], cwd=tmp_path)
    ds = [json.loads(ln) for ln in (tmp_path / "runs/ds-rl/metrics.jsonl").read_text().splitlines()]
    pt = [json.loads(ln) for ln in (tmp_path / "runs/pt-rl/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ds] == [1, 2]
    assert ds[0]["tokens_trained"] == pt[0]["tokens_trained"]
    assert ds[0]["loss"] == pytest.approx(pt[0]["loss"], rel=1e-4, abs=1e-6)
    assert ds[0]["grad_norm"] == pytest.approx(pt[0]["grad_norm"], rel=1e-4)
    load_weights(tmp_path / "runs/ds-rl/final")


def test_torchrun_command(tmp_path, monkeypatch):
    from rlrecipe.cli.stages import relaunch_args

    from rlrecipe.core import dist
    from rlrecipe.core.errors import UserError
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.train import launch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", dist.LAUNCHED_ENV, *launch.NODE_RANK_ENVS):
        monkeypatch.delenv(key, raising=False)
    recipe = recipe_from_dict({"run": {"name": "x"}, "model": {"path": "m"},
                               "trainer": {"engine": "deepspeed", "nproc": 4, "nodes": 2, "master_addr": "10.0.0.1",
                                           "master_port": 29511}})
    loaded = LoadedRecipe(recipe=recipe, path="r.yaml", overrides=["sft.max_steps=5"])
    with pytest.raises(UserError, match="RLRECIPE_NODE_RANK"):
        launch.torchrun_command(recipe.trainer, ["sft"])
    monkeypatch.setenv("RLRECIPE_NODE_RANK", "1")
    cmd = launch.torchrun_command(recipe.trainer, relaunch_args("sft", loaded, resume=True))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes=2", "--node_rank=1",
                       "--master_addr=10.0.0.1", "--master_port=29511", "-m", "rlrecipe.cli.app", "sft", "r.yaml",
                       "--set", "sft.max_steps=5", "--resume"]
    monkeypatch.setenv("RLRECIPE_NODE_RANK", "2")
    with pytest.raises(UserError, match="0..1"):
        launch.torchrun_command(recipe.trainer, ["sft"])
    # one process, or the torch engine: nothing is launched
    single = LoadedRecipe(recipe=recipe_from_dict({"run": {"name": "x"}, "model": {"path": "m"},
                                                   "trainer": {"engine": "deepspeed"}}), path="r.yaml")
    assert launch.maybe_relaunch(single, relaunch_args("rl", single, resume=False)) is None
    assert dist.is_rank_zero() and dist.world_size() == 1


if __name__ == "__main__":
    from rlrecipe.train.launch import end_process

    worker(json.loads(sys.argv[1]))
    end_process(0)  # a rank can abort in the interpreter's teardown after its result is written


LORA = {"lora": {"rank": 4, "alpha": 8}}


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir):
    return torch_reference(tiny_model_dir, **LORA)


@two_ranks
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_on_two_ranks_matches_the_torch_engine_and_resumes_from_the_adapter(stage, tiny_model_dir,
                                                                                  lora_reference, tmp_path):
    """trainer.lora under ZeRO-2/3: the adapter alone trains (the same steps as the torch engine's
    LoRA), the export is the base with the adapter merged and the adapter beside it, and a
    checkpoint holds the adapter and its optimizer but no base, and resumes exactly."""
    from safetensors.torch import load_file

    spec = {"model": str(tiny_model_dir), "stage": stage, "save_at": 2, "ckpt": str(tmp_path / "ckpt"),
            "export": str(tmp_path / "export"), "out": str(tmp_path / "full.json"), "trainer": LORA}
    full = torchrun(spec)
    for i, (ds, ref) in enumerate(zip(full["steps"], lora_reference["steps"], strict=True)):
        assert ds["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), f"step {i + 1} loss"
        assert ds["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL), f"step {i + 1} grad norm"
    exported = load_weights(tmp_path / "export")
    base = load_weights(tiny_model_dir)
    assert set(exported) == set(base)
    moved = [n for n in base if not torch.equal(exported[n], base[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved)  # the adapted linears only
    for name, ref_w in lora_reference["state"].items():
        torch.testing.assert_close(exported[name], ref_w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{n}: {m}")
    adapter = load_file(str(tmp_path / "export" / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
    # the checkpoint: the adapter, and DeepSpeed's state without the frozen base
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model").exists()
    ds_bytes = sum(f.stat().st_size for f in (ckpt / "deepspeed").rglob("*model_states.pt"))
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert ds_bytes < base_bytes / 2, (ds_bytes, base_bytes)

    resumed = torchrun({**spec, "resume": str(ckpt), "save_at": None, "export": str(tmp_path / "export_resumed"),
                        "out": str(tmp_path / "resumed.json")})
    assert resumed["start"] == 2 and len(resumed["steps"]) == 1
    assert resumed["steps"][0]["loss"] == pytest.approx(full["steps"][2]["loss"], rel=1e-6)
    assert resumed["steps"][0]["grad_norm"] == pytest.approx(full["steps"][2]["grad_norm"], rel=1e-6)
    resumed_w = load_weights(tmp_path / "export_resumed")
    for name, w in exported.items():
        torch.testing.assert_close(resumed_w[name], w, rtol=0, atol=1e-6)



@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_another_adapter_or_none_is_refused_on_resume(stage, tiny_model_dir, tmp_path):
    """DeepSpeed loads a LoRA checkpoint's module state leniently (the frozen base is not in it), which
    would pass over adapter tensors missing from it: a rank 8 checkpoint resumed at rank 4 or without
    LoRA, or whose module state lacks a tensor, is refused in one line naming the checkpoint."""
    ckpt = tmp_path / "ckpt"
    spec = {"model": str(tiny_model_dir), "stage": stage, "save_at": 1, "ckpt": str(ckpt),
            "export": str(tmp_path / "export"), "out": str(tmp_path / "o.json"), "trainer": {"lora": {"rank": 8}}}
    torchrun(spec, nproc=0)
    for trainer in ({"lora": {"rank": 4}}, {}):
        said = torchrun({**spec, "resume": str(ckpt), "trainer": trainer}, nproc=0).get("refused", "")
        assert said.startswith(str(ckpt)) and len(said.splitlines()) == 1, said
    shutil.copytree(ckpt, tmp_path / "lacking")
    states, = (tmp_path / "lacking" / "deepspeed").rglob("*model_states.pt")
    saved = torch.load(states, weights_only=False)
    gone = next(k for k in saved["module"] if ".lora_B." in k)
    del saved["module"][gone]
    torch.save(saved, states)
    said = torchrun({**spec, "resume": str(tmp_path / "lacking")}, nproc=0).get("refused", "")
    assert said.startswith(str(tmp_path / "lacking" / "deepspeed")) and gone in said and len(said.splitlines()) == 1
