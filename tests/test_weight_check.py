"""The fingerprint after each weight push (rollout/weight_check.py) against `rlrecipe serve`, including a
server whose weight load is sabotaged: the update answers 200, the weights stay the old ones."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import requests
import torch

from rlrecipe.modeling import load_model, load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout import weight_check
from rlrecipe.rollout.sglang import SGLangEngine
from tests.test_sglang_client import BOOT_TIMEOUT_S, free_port, rlrecipe_cmd, stop_process

# `rlrecipe serve` whose engine answers every weight update without loading anything
SABOTAGED = textwrap.dedent("""
    import sys
    from rlrecipe.rollout.inprocess import InProcessEngine

    def keep_old_weights(self, source, version):
        self.version = version

    InProcessEngine.update_weights_from_disk = keep_old_weights
    InProcessEngine.update_weights_from_state = keep_old_weights
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
        bad, bad_url = start([sys.executable, str(tmp / "sabotaged.py"), str(tiny_model_dir), str(p2)], p2,
                             tmp / "bad.log")
        procs.append(bad)
        yield {"good": good_url, "bad": bad_url}
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_the_endpoint_answers_as_sglang_first_rows_as_float32_lists(servers, tiny_model_dir):
    model = load_model(tiny_model_dir)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight"):
        for method in ("post", "get"):  # SGLang routes both, with the JSON body
            r = getattr(requests, method)(servers["good"] + "/get_weights_by_name",
                                          json={"name": name, "truncate_size": 3}, timeout=30)
            assert r.status_code == 200
            assert torch.equal(torch.tensor(r.json()), model.get_parameter(name)[:3].float())
    r = requests.post(servers["good"] + "/get_weights_by_name", json={"name": "no.such.weight"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()


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
        assert msg.startswith(f"SGLang server {servers['bad']}: after the update to weight version 1, parameter ")
        assert servers["good"] not in msg and "is not the trainer's" in msg and "values differ" in msg
        with pytest.raises(weight_check.WeightMismatch, match=f"SGLang server {servers['bad']}: .*version 2"):
            eng.update_weights_from_state(load_model(other_model_dir).state_dict(), 2)
    finally:
        eng.close()


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
                                     f"{other_model_dir.resolve()}, parameter ")
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
