"""Weight verification after each push (rollout/weights/check.py, weights/checksum.py) against `rlrecipe serve`,
which answers as SGLang 0.5.23 does: /weights_checker checksums for any model, /get_weights_by_name only for
Llama-like ones. One server is faithful; one answers every update with 200 and keeps its weights (from
weight version KEEP_FROM on, given as its third argument: 0 keeps the weights it started with)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time

import pytest
import requests
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.weights import check as weight_check
from rlrecipe.rollout.weights.checksum import ServerChecksums, judge, model_checksums, tensor_checksum
from tests.rollout.test_sglang_client import BOOT_TIMEOUT_S, free_port, rlrecipe_cmd, stop_process

SABOTAGED = textwrap.dedent("""
    import sys
    from rlrecipe.rollout.weights.sync import receive
    from rlrecipe.serve import scheduler

    KEEP_FROM = int(sys.argv[3])
    real_load = scheduler.Scheduler._load_update

    def load_or_keep(self, job):
        version = job.get("weight_version")
        if version is None or int(version) < KEEP_FROM:
            return real_load(self, job)
        if "group" in job:  # the broadcast is received, or the trainer would wait for it
            receive(job["group"], job["names"], job["dtypes"], job["shapes"])
        self.weight_version = str(version)
        job["result"] = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    scheduler.Scheduler._load_update = load_or_keep
    from rlrecipe.serve.http_server import serve_forever

    serve_forever(sys.argv[1], port=int(sys.argv[2]))
""")


def start(cmd: list[str], port: int, log_path):
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while True:
        assert proc.poll() is None, log_path.read_text()[-2000:]
        try:
            if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, log_path.read_text()[-2000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """One faithful `rlrecipe serve` and one sabotaged, both serving the tiny model."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "sabotaged.py").write_text(SABOTAGED)
    p1, p2 = free_port(), free_port()
    procs = []
    try:
        good, good_url = start([*rlrecipe_cmd(), "serve", str(tiny_model_dir), "--port", str(p1)], p1, tmp / "good.log")
        procs.append(good)
        bad, bad_url = start([sys.executable, str(tmp / "sabotaged.py"), str(tiny_model_dir), str(p2), "0"], p2,
                             tmp / "bad.log")
        procs.append(bad)
        yield {"good": good_url, "bad": bad_url}
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_get_weights_by_name_answers_as_sglang_only_for_the_models_sglang_has_it_for(servers, tmp_path):
    """Qwen2 (the tiny model, every recipe's family): 400 as SGLang 0.5.23; a Llama model: first rows
    as float32 lists, on POST and GET with the JSON body."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlrecipe.modeling import build_char_tokenizer
    from tests.helpers import serving_in_thread

    r = requests.post(servers["good"] + "/get_weights_by_name", json={"name": "model.norm.weight"}, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": {"message": "Get parameter by name failed"}}
    llama_dir = tmp_path / "llama"
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    llama.save_pretrained(llama_dir)
    build_char_tokenizer().save_pretrained(llama_dir)
    with serving_in_thread(llama_dir) as (port, _):
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight"):
            for method in ("post", "get"):
                r = getattr(requests, method)(f"http://127.0.0.1:{port}/get_weights_by_name",
                                              json={"name": name, "truncate_size": 3}, timeout=30)
                assert r.status_code == 200
                assert torch.equal(torch.tensor(r.json()), llama.get_parameter(name)[:3].float())
        r = requests.post(f"http://127.0.0.1:{port}/get_weights_by_name", json={"name": "no.such"}, timeout=30)
        assert r.status_code == 400 and "error" in r.json()


def test_weights_checker_answers_checksums_as_sglang_computes_them_on_the_cpu(servers, tiny_model_dir):
    r = requests.post(servers["good"] + "/weights_checker", json={"action": "checksum"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["success"] and len(body["ranks"]) == 1
    sums = body["ranks"][0]["checksums"]
    state = dict(load_model(tiny_model_dir).named_parameters())
    assert sums == model_checksums(state) and "model.norm.weight" in sums
    # the first 8 bytes of the SHA-256 of the raw bytes, big-endian, 16 hex digits (SGLang's CPU path)
    norm = state["model.norm.weight"].detach()
    assert sums["model.norm.weight"] == hashlib.sha256(norm.numpy().tobytes()).digest()[:8].hex()
    overall = hashlib.sha256(b"".join(n.encode() + sums[n].encode() for n in sorted(sums))).hexdigest()
    assert body["ranks"][0]["per_gpu_checksum"] == overall
    assert requests.post(servers["good"] + "/weights_checker", json={"action": "snapshot"}, timeout=30).status_code == 400


def test_a_faithful_server_passes_after_disk_and_broadcast_pushes(servers, tok, tiny_model_dir, other_model_dir):
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port())
    eng = SGLangEngine([servers["good"]], eos_token_id=tok.eos_token_id, cfg=cfg, served_dtype="float32")
    try:
        eng.update_weights_from_disk(other_model_dir, 1)
        assert not eng.no_weight_check and "weight_check_s" in eng.fleet_metrics()
        eng.update_weights_from_state(load_model(tiny_model_dir).state_dict(), 2)
        assert not eng.no_weight_check
    finally:
        eng.close()


def test_a_server_that_answers_200_but_keeps_old_weights_is_named(servers, tok, tiny_model_dir, other_model_dir):
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port())
    eng = SGLangEngine([servers["good"], servers["bad"]], eos_token_id=tok.eos_token_id, cfg=cfg)
    try:
        with pytest.raises(weight_check.WeightMismatch) as err:
            eng.update_weights_from_disk(other_model_dir, 1)
        msg = str(err.value)
        assert msg.startswith(f"SGLang server {servers['bad']}: after the update to weight version 1, its weights "
                              "are not the trainer's (")
        assert servers["good"] not in msg and "tensors differ from the trainer's" in msg and "\n" not in msg
        with pytest.raises(weight_check.WeightMismatch, match=f"SGLang server {servers['bad']}: .*version 2"):
            eng.update_weights_from_state(load_model(other_model_dir).state_dict(), 2)
    finally:
        eng.close()


def _sums(**names) -> dict[str, str]:
    return {n: f"{v:016x}" for n, v in names.items()}


def test_checksums_judged_where_the_server_hashes_otherwise():
    """A GPU server's checksums (Triton) never equal the trainer's: then every tensor the trainer changed
    must have changed on every rank; one that kept them all is stale, one that kept some is wrong."""
    trainer0, trainer1 = _sums(a=1, b=2, c=3), _sums(a=1, b=20, c=30)  # b and c changed, a did not
    gpu0 = [_sums(a=101, b=102, c=103, qkv=104)] * 2  # two ranks, own hashes, a fused tensor too
    assert judge(gpu0, trainer0, None)[0] == "undecided"
    before = ServerChecksums(gpu0, trainer0, version=4)
    assert judge([_sums(a=101, b=202, c=203, qkv=204)] * 2, trainer1, before)[0] == "ok"
    verdict, detail = judge(gpu0, trainer1, before)
    assert verdict == "stale" and "none of the 2 tensors the trainer changed" in detail
    verdict, detail = judge([_sums(a=101, b=202, c=203, qkv=204), _sums(a=101, b=202, c=103, qkv=204)], trainer1,
                            before)
    assert verdict == "wrong" and detail.startswith("rank 1: 1 of 2 tensors the trainer changed did not change")
    assert judge(gpu0, trainer0, before)[0] == "undecided"  # the trainer changed nothing compared
    # a CPU server hashes as the trainer does: exact, and stale where it answers as when last verified
    cpu = [_sums(a=1, b=2, c=3)]
    assert judge(cpu, trainer0, None) == ("ok", "3 tensors match the trainer's bit for bit")
    assert judge(cpu, trainer1, ServerChecksums(cpu, trainer0))[0] == "stale"
    assert judge([_sums(a=1, b=20, c=31)], trainer1, None, cpu_hash=True)[0] == "wrong"
    assert judge([_sums(a=7, b=8, c=9)], trainer1, None, cpu_hash=True)[0] == "wrong"  # none agrees


def test_a_gpu_server_with_offloaded_weights_is_judged_tensor_by_tensor():
    """--cpu-offload-gb: the server hashes the tensors it holds on the CPU with SHA-256 (they agree
    with the trainer's) and the rest on the GPU. The first are compared bit for bit, from then on
    too; the others by whether they changed. Deciding once per server took the GPU-hashed ones for
    wrong."""
    trainer0, trainer1 = _sums(a=1, b=2, c=3), _sums(a=10, b=20, c=30)
    start = [_sums(a=1, b=102, c=103)]  # a offloaded: hashed as the trainer hashes
    verdict, detail = judge(start, trainer0, None)
    assert verdict == "ok" and detail.startswith("1 tensors match the trainer's bit for bit; the other 2 are hashed")
    before = ServerChecksums(start, trainer0, version=1)
    assert judge([_sums(a=10, b=202, c=203)], trainer1, before)[0] == "ok"
    # a, known to be hashed as the trainer's, is not the trainer's: wrong, though b and c changed
    verdict, detail = judge([_sums(a=11, b=202, c=203)], trainer1, before)
    assert verdict == "wrong" and "a" in detail
    assert judge([_sums(a=1, b=202, c=203)], trainer1, before)[0] == "stale"  # a kept as it was
    verdict, detail = judge([_sums(a=10, b=202, c=103)], trainer1, before)  # c did not change
    assert verdict == "wrong" and "did not change, e.g. c" in detail


def test_a_bf16_step_at_the_recipes_learning_rate_changes_every_large_tensors_checksum():
    """At lr 1e-6 (7b_boba) most bf16 values stay as they were after one step, yet a tensor of a
    million values does not: the trainer's changed checksums are what a stale server is held to."""
    torch.manual_seed(0)
    w = torch.randn(1024, 1024) * 0.02
    step = w + 1e-6 * torch.randn_like(w).sign()  # Adam's first steps move each weight by about lr
    flipped = (w.bfloat16() != step.bfloat16()).float().mean().item()
    assert 0 < flipped < 0.05
    assert tensor_checksum(w.bfloat16()) != tensor_checksum(step.bfloat16())
    norm = torch.ones(64)
    assert tensor_checksum((norm + 1e-6).bfloat16()) == tensor_checksum(norm.bfloat16())  # a norm may not


def test_sampled_parameters_change_with_the_version_and_skip_huge_ones():
    shapes = {"model.embed_tokens.weight": (152064, 3584), "model.norm.weight": (3584,),
              **{f"model.layers.{i}.self_attn.k_proj.weight": (512, 3584) for i in range(28)}}
    a, b = weight_check.sample_names(shapes, 1), weight_check.sample_names(shapes, 2)
    assert a[0] == b[0] == "model.norm.weight" and len(a) == weight_check.SAMPLES
    assert a != b and a == weight_check.sample_names(shapes, 1)  # per version, reproducibly
    assert all("embed_tokens" not in n for n in a + b)  # 545M values: SGLang would list them all


def test_tolerance_accepts_a_bf16_cast_and_refuses_other_weights():
    torch.manual_seed(0)
    trainer = torch.randn(2, 64)  # fp32 master weights
    served = trainer.to(torch.bfloat16).float().tolist()  # what a bf16 server answers
    assert weight_check.compare(trainer, served, torch.bfloat16) is None
    # the same values through fp16 first: within one bf16 unit, still the same weights
    assert weight_check.compare(trainer, trainer.half().to(torch.bfloat16).float().tolist(), torch.bfloat16) is None
    other = (trainer + 0.05 * torch.randn(2, 64)).to(torch.bfloat16).float().tolist()
    assert "values differ" in weight_check.compare(trainer, other, torch.bfloat16)
    # fp16 is finer: a bf16 rounding shows there
    assert "values differ" in weight_check.compare(trainer, served, torch.float16)
    # dp_size 2: one list per replica; a bad replica is named
    assert weight_check.compare(trainer, [served, served], torch.bfloat16) is None
    assert "dp replica 1" in weight_check.compare(trainer, [served, other], torch.bfloat16)
    assert "shape" in weight_check.compare(trainer, served[:1], torch.bfloat16)


def test_attached_servers_that_do_not_serve_the_starting_model_are_named_before_any_request(
        servers, tok, tiny_model_dir, other_model_dir):
    """A server asked to load the stage's model answers 200 and keeps other weights: the engine
    refuses at construction, before a rollout samples from the wrong model; a faithful one passes."""
    from rlrecipe.recipe.schema import recipe_from_dict
    from rlrecipe.rollout.factory import make_rollout_engine

    def recipe(url):
        return recipe_from_dict({"run": {"name": "t"}, "model": {"path": str(other_model_dir)},
                                 "rollout": {"engine": "sglang", "dtype": "float32", "urls": [url]}})

    with pytest.raises(weight_check.WeightMismatch) as err:
        make_rollout_engine(recipe(servers["bad"]), other_model_dir, tok)
    assert str(err.value).startswith(f"SGLang server {servers['bad']}: at start, where it should serve "
                                     f"{other_model_dir.resolve()}, its weights are not the trainer's (")
    eng = make_rollout_engine(recipe(servers["good"]), other_model_dir, tok)
    try:
        assert eng.weight_check_s > 0 and not eng.no_weight_check  # it was asked, and it answered
    finally:
        eng.update_weights_from_disk(tiny_model_dir, 0)  # the module's servers serve the tiny model
        eng.close()


def test_an_rl_run_whose_attached_server_cannot_read_the_export_stops_before_its_first_rollout(
        tmp_path, tiny_model_dir):
    """weight_sync: disk with attached servers: the starting weights go through run.dir once at start,
    so a server that cannot read there (another node without the mount) stops the run at once, with
    the server named, instead of at the end of step 1's rollouts."""
    from rlrecipe.core.errors import UserError
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.stages.rl import run_rl
    from tests.helpers import rl_recipe, serving_in_thread, write_tiny_data

    data = write_tiny_data(tmp_path / "data")
    with serving_in_thread(tiny_model_dir) as (port, sched):
        real_update, generated = sched.update_weights, []

        def unreadable_under_runs(model_path, weight_version, timeout=3600.0):
            if str(tmp_path / "runs") in model_path:
                return {"success": False, "message": f"[Errno 2] No such file or directory: '{model_path}'"}
            return real_update(model_path, weight_version, timeout)

        sched.update_weights = unreadable_under_runs
        real_submit = sched.submit
        # rollouts only: the health probe generates one token of its own
        sched.submit = lambda reqs: (generated.extend(r for r in reqs if r.return_logprob), real_submit(reqs))[1]
        spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=2, c3po={"enabled": False})
        spec["eval"] = {}
        spec["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 8,
                           "urls": [f"http://127.0.0.1:{port}"], "sglang": {"weight_sync": "disk"}}
        with pytest.raises(UserError) as err:
            run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="attached.yaml"))
    msg = str(err.value)
    assert f"SGLang server http://127.0.0.1:{port} /update_weights_from_disk failed" in msg
    assert "No such file or directory" in msg and str(tmp_path / "runs" / "rl" / "weights_for_rollout") in msg
    assert generated == []  # no rollout was sampled


@pytest.mark.slow
@pytest.mark.parametrize("sync, sglang", [("distributed", "0.5.23"), ("disk", "0.5.23"), ("disk", "0.5.1"),
                                          ("distributed", "0.5.1")])
def test_an_rl_run_stops_at_the_push_a_server_keeps_its_weights_and_keeps_what_it_saved(
        sync, sglang, tmp_path, tiny_model_dir, capfd, monkeypatch):
    """A server answering as SGLang 0.5.23 (a weight-update session for broadcasts, Qwen2 without
    /get_weights_by_name: checksums decide) or as 0.5.1 (no session, no checksums: the probe's log-probs
    decide) trains through step 1's push; from weight version 2 on it answers 200 and keeps version 1's
    weights: the run stops at step 2's push with one line naming the server and the weights it still
    serves, and step 1's checkpoint stays whole."""
    from rlrecipe.core.errors import UserError
    from rlrecipe.recipe.schema import LoadedRecipe, recipe_from_dict
    from rlrecipe.run.manifest import check_manifest
    from rlrecipe.stages.rl import run_rl
    from tests.helpers import rl_recipe, write_tiny_data

    (tmp_path / "sabotaged.py").write_text(SABOTAGED)
    port = free_port()
    monkeypatch.setenv("RLRECIPE_SERVE_SGLANG", sglang)  # the server's rules (the run itself reads none of it)
    proc, url = start([sys.executable, str(tmp_path / "sabotaged.py"), str(tiny_model_dir), str(port), "2"], port,
                      tmp_path / "server.log")
    try:
        data = write_tiny_data(tmp_path / "data")
        spec = rl_recipe(tmp_path, data, str(tiny_model_dir), steps=3, c3po={"enabled": False})
        spec["eval"] = {}
        spec["rollout"] = {"engine": "sglang", "dtype": "float32", "max_new_tokens": 8, "urls": [url],
                           "sglang": {"weight_sync": sync, "weight_sync_backend": "gloo",
                                      "weight_sync_port": free_port()}}
        with pytest.raises(UserError) as err:
            run_rl(LoadedRecipe(recipe=recipe_from_dict(spec), path="sabotaged.yaml"))
    finally:
        stop_process(proc)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"SGLang server {url}: after the update to weight version 2, it still serves the weights "
                          "of version 1 (")
    assert ("its log-probs of the probe are" in msg) == (sglang == "0.5.1")
    assert "after the update to weight version 1" not in capfd.readouterr().err  # step 1's push was verified
    log = (tmp_path / "server.log").read_text()
    if sync == "distributed":
        assert "joined weight update group" in log
    run_dir = tmp_path / "runs" / "rl"
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["latest", "step_0000001"]  # step 1 saved, nothing of step 2
    assert check_manifest(run_dir / "checkpoints" / "step_0000001") is None  # whole: every file as written


def test_the_vocabulary_rows_are_hashed_as_sglang_pads_them():
    """SGLang's VocabParallelEmbedding holds 261 rows as 320 (a multiple of 64), the rest zero, and
    hashes that; other tensors, and vocabularies already a multiple of 64, are hashed as they are."""
    from rlrecipe.rollout.weights.checksum import served_checksum

    emb = torch.randn(261, 8, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([emb, torch.zeros(59, 8)])
    by_hand = hashlib.sha256(padded.numpy().tobytes()).digest()[:8].hex()
    assert served_checksum("model.embed_tokens.weight", emb) == by_hand
    assert served_checksum("lm_head.weight", emb) == by_hand
    assert served_checksum("model.layers.0.mlp.down_proj.weight", emb) == tensor_checksum(emb) != by_hand
    assert served_checksum("model.embed_tokens.weight", padded) == tensor_checksum(padded)


def test_an_attached_server_is_compared_in_the_dtype_it_says_it_serves(tmp_path):
    """A Llama model served in bfloat16 while rollout.dtype says float32: its rows are the trainer's
    cast to bfloat16, which compared as float32 differ by far more than float32's rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlrecipe.modeling import build_char_tokenizer
    from tests.helpers import serving_in_thread

    llama_dir = tmp_path / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64)).save_pretrained(llama_dir)
    build_char_tokenizer().save_pretrained(llama_dir)
    with serving_in_thread(llama_dir, dtype="bfloat16") as (port, _):
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/server_info", timeout=10).json()["dtype"] == "bfloat16"
        with SGLangEngine([url], served_dtype="float32") as eng:
            eng.verify_export(llama_dir, 0, when="at start")
            assert eng.weights.check.no_rows == set()  # the rows were compared, in bfloat16
        # the same rows judged as float32 would not pass: the comparison can tell the two apart
        rows = weight_check.export_slices(llama_dir, 0)
        answer = {n: t.to(torch.bfloat16).float().tolist() for n, t in rows.items()}
        assert any(weight_check.compare(t, answer[n], torch.float32) for n, t in rows.items())
        assert not any(weight_check.compare(t, answer[n], torch.bfloat16) for n, t in rows.items())
