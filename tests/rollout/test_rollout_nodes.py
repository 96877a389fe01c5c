"""`rlrecipe rollout-servers`: a node's share of the recipe's SGLang servers, and the layouts refused.

The split, the command lines and the refusals are checked value by value (real SGLang needs a
GPU); the start, the shared URL list and the stop run for real, with stand-in servers started
through `rollout.sglang.launch_cmd` by the command itself in its own process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import load_recipe, recipe_from_dict
from rlrecipe.recipe.systems import SGLangServer, TrainerSection
from rlrecipe.rollout.factory import make_rollout_engine
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.node_servers import plan_node, read_urls, update_urls
from rlrecipe.rollout.sglang.server import check_gpus, server_specs, trainer_gpus_on_node
from tests.rollout.test_sglang_client import free_ports

REPO = Path(__file__).resolve().parents[2]
BOBA = REPO / "recipes" / "7b_boba.yaml"
WAIT_S = 120.0  # bound on waiting for stand-in servers on a loaded 2-core machine (not asserted)

# Answers 200 on /health and /health_generate, as SGLang does once it generates; writes its pid.
STAND_IN = r"""
import os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, pid_file = int(sys.argv[1]), sys.argv[2]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/health_generate") else 404)
        self.send_header("Content-Length", "0"); self.end_headers()
server = ThreadingHTTPServer(("127.0.0.1", port), H)
open(pid_file, "w").write(str(os.getpid()))
print("stand-in server on", port, flush=True)
server.serve_forever()
"""


def sglang_recipe(**sglang) -> dict:
    return {"run": {"name": "t"}, "model": {"path": "org/model"},
            "rollout": {"engine": "sglang", "sglang": sglang}}


# -- the split ----------------------------------------------------------------------------------------
def test_64_servers_over_8_nodes_node_3_starts_servers_24_to_31():
    plan = plan_node(load_recipe(BOBA).recipe, 3, gpus=8, url_host="node3")
    # 64 / 8 = 8 servers a node: node 3 has 3 x 8 = 24 .. 31, on ports 30000 + i, one GPU each from 0
    assert [s.index for s in plan.specs] == [24, 25, 26, 27, 28, 29, 30, 31]
    assert [s.port for s in plan.specs] == [30024, 30025, 30026, 30027, 30028, 30029, 30030, 30031]
    assert [s.base_gpu for s in plan.specs] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert plan.urls == [f"http://node3:{p}" for p in range(30024, 30032)]
    assert plan.gpus == 8
    cmd = plan.specs[5].cmd  # server 29
    assert cmd[cmd.index("--port") + 1] == "30029" and cmd[cmd.index("--base-gpu-id") + 1] == "5"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--dtype") + 1] == "float16"
    assert cmd[cmd.index("--model-path") + 1] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    # the hub id at the recipe's pinned snapshot, the one the trainer reads
    assert cmd[cmd.index("--revision") + 1] == load_recipe(BOBA).recipe.model.revision == "916b56a44061fd5cd7d6a8fb632557ed4f724f60"


def test_a_local_model_directory_is_served_as_it_is(tmp_path):
    (tmp_path / "m").mkdir()
    recipe = recipe_from_dict({"run": {"name": "t"}, "model": {"path": str(tmp_path / "m"), "revision": None},
                               "rollout": {"engine": "sglang", "sglang": {"num_servers": 2, "nodes": 2}}})
    cmd = plan_node(recipe, 1, gpus=1).specs[0].cmd
    assert cmd[cmd.index("--model-path") + 1] == str((tmp_path / "m").resolve()) and "--revision" not in cmd
    unpinned = plan_node(recipe_from_dict(sglang_recipe(num_servers=2, nodes=2)), 0, gpus=1).specs[0].cmd
    assert "--revision" not in unpinned  # a hub id without model.revision: SGLang's default, as the trainer's


def test_a_launch_cmd_gets_the_pinned_revision_as_a_placeholder():
    pinned = recipe_from_dict({**sglang_recipe(num_servers=2, nodes=2, launch_cmd=["serve", "{model}", "@{revision}"]),
                               "model": {"path": "org/model", "revision": "a" * 40}})
    assert plan_node(pinned, 0, gpus=None).specs[0].cmd == ["serve", "org/model", "@" + "a" * 40]
    unpinned = recipe_from_dict(sglang_recipe(num_servers=2, nodes=2, launch_cmd=["serve", "{model}", "@{revision}"]))
    assert plan_node(unpinned, 0, gpus=None).specs[0].cmd == ["serve", "org/model", "@"]


def test_a_node_share_of_tp2_dp2_servers_takes_four_gpus_each():
    recipe = recipe_from_dict(sglang_recipe(num_servers=8, nodes=2, tp_size=2, dp_size=2, base_port=31000))
    plan = plan_node(recipe, 1, gpus=16, url_host="10.0.0.2")
    # node 1 of 2: servers 4..7 on ports 31004..31007, each on 2 x 2 = 4 GPUs: from 0, 4, 8, 12
    assert [(s.index, s.port, s.base_gpu) for s in plan.specs] == [
        (4, 31004, 0), (5, 31005, 4), (6, 31006, 8), (7, 31007, 12)]
    assert plan.gpus == 16
    assert plan.urls[0] == "http://10.0.0.2:31004"


def test_the_run_on_one_node_places_servers_after_the_trainers_gpus():
    cfg = SGLangServer(num_servers=2, tp_size=2)
    trainer = trainer_gpus_on_node(TrainerSection(nproc=4))
    assert trainer == 4
    specs = server_specs("m", cfg, range(2), dtype="bfloat16", seed=1, gpu_offset=trainer)
    assert [s.base_gpu for s in specs] == [4, 6]  # GPUs 0..3 train; server 0 on 4-5, server 1 on 6-7
    assert specs[1].cmd[specs[1].cmd.index("--base-gpu-id") + 1] == "6"
    check_gpus(cfg, visible=8, trainer_gpus=4)  # 4 + 2 x 2 = 8: fits exactly
    with pytest.raises(UserError) as err:
        check_gpus(cfg, visible=8, trainer_gpus=5)
    msg = str(err.value)
    assert "num_servers 2 x tp_size 2 x dp_size 1 = 4 GPUs after the trainer's 5 (trainer.nproc, GPUs 0..4) = 9" in msg
    assert "has 8" in msg and "trainer.nproc" in msg


# -- refusals -----------------------------------------------------------------------------------------
def test_servers_that_do_not_split_over_the_nodes_are_refused_when_the_recipe_loads():
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(sglang_recipe(num_servers=60, nodes=8), "r.yaml")
    msg = str(err.value)
    assert msg.startswith("r.yaml: rollout.sglang:") and "num_servers 60 does not split evenly over nodes 8" in msg


def test_a_node_share_needing_more_gpus_than_the_node_has_is_refused():
    recipe = load_recipe(BOBA).recipe
    with pytest.raises(UserError) as err:
        plan_node(recipe, 0, gpus=7)
    assert str(err.value) == ("rollout.sglang: num_servers 64 / nodes 8 = 8 servers per node x tp_size 1 x dp_size 1 "
                              "= 8 GPUs, but this node has 7 (--gpus); raise rollout.sglang.nodes or lower "
                              "num_servers, tp_size or dp_size")
    with pytest.raises(UserError, match=r"--node 8: rollout.sglang.nodes is 8, so --node is one of 0..7"):
        plan_node(recipe, 8, gpus=8)


def test_what_rollout_servers_cannot_start_is_refused():
    inprocess = recipe_from_dict({"run": {"name": "t"}, "model": {"path": "m"}})
    with pytest.raises(UserError, match="rollout.engine is inprocess"):
        plan_node(inprocess, 0, gpus=8)
    tiny = recipe_from_dict({"run": {"name": "t"}, "model": {"tiny": {}}, "rollout": {"engine": "sglang"}})
    with pytest.raises(UserError, match="model: SGLang servers need model.path or run.init_from"):
        plan_node(tiny, 0, gpus=8)


def test_distributed_weight_sync_with_dp_size_above_1_is_refused_when_the_recipe_loads():
    with pytest.raises(RecipeError) as err:
        load_recipe(BOBA, ["rollout.sglang.weight_sync=distributed", "rollout.sglang.dp_size=2"])
    msg = str(err.value)
    assert msg.startswith(f"{BOBA}: rollout.sglang:")
    assert "weight_sync: distributed with dp_size 2" in msg and "dp_size 1" in msg
    # each alone is fine
    assert load_recipe(BOBA, ["rollout.sglang.weight_sync=distributed"]).recipe.rollout.sglang.dp_size == 1
    load_recipe(BOBA, ["rollout.sglang.dp_size=2", "rollout.sglang.nodes=16", "rollout.sglang.num_servers=32"])


def test_the_run_launches_no_servers_when_they_are_spread_over_nodes(tmp_path):
    cfg = SGLangServer(num_servers=2, nodes=2, base_port=free_ports(2),
                       launch_cmd=[sys.executable, "-c", STAND_IN, "{port}", str(tmp_path / "pid_{index}")])
    with pytest.raises(UserError) as err:
        SGLangEngine.launch("m", cfg=cfg, run_dir=tmp_path)
    msg = str(err.value)
    assert "rollout.sglang.nodes is 2" in msg and "rlrecipe rollout-servers RECIPE --node N" in msg
    assert "rollout.urls" in msg
    assert not list(tmp_path.glob("pid_*"))  # nothing was started


def test_an_rl_run_without_the_urls_of_servers_spread_over_nodes_stops_before_it_starts():
    from rlrecipe.checks.preflight import check_stage_inputs

    with pytest.raises(RecipeError) as err:
        check_stage_inputs(load_recipe(BOBA), "rl")
    msg = str(err.value)
    assert msg.startswith(f"{BOBA}: rollout.urls: empty, but rollout.sglang.nodes is 8")
    assert f"rlrecipe rollout-servers {BOBA} --node N --urls-out FILE" in msg


def test_servers_launched_beside_training_get_gpu_ids_after_the_trainers(tmp_path):
    base = free_ports(2)
    recipe = recipe_from_dict({
        "run": {"name": "t"}, "model": {"path": "m"}, "trainer": {"nproc": 3},
        "rollout": {"engine": "sglang", "sglang": {
            "num_servers": 2, "tp_size": 2, "base_port": base, "startup_timeout_s": WAIT_S,
            "launch_cmd": [sys.executable, "-c", STAND_IN, "{port}", str(tmp_path / "pid_{index}"),
                           "--base-gpu-id={base_gpu_id}"]}}})
    tok = SimpleNamespace(eos_token_id=1)
    for beside, first in ((True, 3), (False, 0)):
        eng = make_rollout_engine(recipe, "m", tok, run_dir=tmp_path, beside_training=beside)
        try:
            # trainer ranks hold GPUs 0..2: server 0 from GPU 3, server 1 from 3 + 2; alone: 0 and 2
            assert [s.cmd[-1] for s in eng.servers] == [f"--base-gpu-id={first}", f"--base-gpu-id={first + 2}"]
        finally:
            eng.close()


# -- the shared URL list ------------------------------------------------------------------------------
def test_nodes_merge_their_urls_into_one_list_in_server_order(tmp_path):
    path = tmp_path / "shared" / "urls.yaml"
    update_urls(path, ["http://n1:30002", "http://n1:30003"], add=True)
    update_urls(path, ["http://n0:30000", "http://n0:30001"], add=True)
    assert read_urls(path) == ["http://n0:30000", "http://n0:30001", "http://n1:30002", "http://n1:30003"]
    # node 1 restarts under another address: its entries are replaced, not doubled
    update_urls(path, ["http://n1b:30002", "http://n1b:30003"], add=True)
    assert read_urls(path) == ["http://n0:30000", "http://n0:30001", "http://n1b:30002", "http://n1b:30003"]
    # the file is what --set rollout.urls=... takes
    text = path.read_text()
    over = load_recipe(BOBA, [f"rollout.urls={text}"]).recipe.rollout.urls
    assert over == ["http://n0:30000", "http://n0:30001", "http://n1b:30002", "http://n1b:30003"]
    update_urls(path, ["http://n1b:30002", "http://n1b:30003"], add=False)
    assert read_urls(path) == ["http://n0:30000", "http://n0:30001"]
    path.write_text("rollout: {urls: []}\n")
    with pytest.raises(UserError, match="urls.yaml: not a YAML list of URLs"):
        update_urls(path, ["http://n0:30000"], add=True)


# -- the command --------------------------------------------------------------------------------------
def test_dry_run_prints_each_command_and_the_urls(monkeypatch):
    from rlrecipe.cli.app import app

    monkeypatch.setenv("SGLANG_API_KEY", "s3cret")
    result = CliRunner().invoke(app, ["rollout-servers", str(BOBA), "--node", "3", "--gpus", "8",
                                      "--url-host", "node3", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "# node 3 of 8: servers 24..31, 8 GPUs"
    assert lines[1] == "# server 24: port 30024, GPUs 0..0"
    assert lines[2] == (f"{sys.executable} -m sglang.launch_server --model-path deepseek-ai/DeepSeek-R1-Distill-Qwen-7B "
                        "--host 0.0.0.0 --port 30024 --tp-size 1 --dp-size 1 --mem-fraction-static 0.8 --dtype "
                        "float16 --random-seed 1 --base-gpu-id 0 --revision 916b56a44061fd5cd7d6a8fb632557ed4f724f60 "
                        "--api-key \"$SGLANG_API_KEY\"")
    assert lines[15] == "# server 31: port 30031, GPUs 7..7"
    assert "--port 30031" in lines[16] and "--base-gpu-id 7" in lines[16]
    assert lines[17:] == ["# rollout.urls from this node:", *(f"- http://node3:{p}" for p in range(30024, 30032))]
    assert "s3cret" not in result.output


def test_dry_run_refusals_are_one_line_exit_2():
    for args, expected in (
            (["--node", "0", "--gpus", "4"], "= 8 GPUs, but this node has 4 (--gpus)"),
            (["--node", "0", "--set", "rollout.sglang.nodes=7"], "num_servers 64 does not split evenly over nodes 7")):
        proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "rollout-servers", str(BOBA), *args,
                               "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=WAIT_S)
        assert proc.returncode == 2, proc.stderr
        assert expected in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def _wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _start_node(tmp_path: Path, base: int, urls: Path, **sglang) -> subprocess.Popen:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(sglang_recipe(
        num_servers=4, nodes=2, base_port=base, startup_timeout_s=WAIT_S, **sglang,
        launch_cmd=[sys.executable, "-c", STAND_IN, "{port}", str(tmp_path / "pid_{index}")])))
    return subprocess.Popen([sys.executable, "-m", "rlrecipe.cli.app", "rollout-servers", str(recipe), "--node", "1",
                             "--urls-out", str(urls), "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _pids(tmp_path: Path) -> dict[int, int]:
    return {i: int((tmp_path / f"pid_{i}").read_text()) for i in (2, 3)}


def _ended_after(proc: subprocess.Popen, action) -> tuple[str, str]:
    """Do `action` to the running command, then wait for it to end: (stdout, stderr). Killed if
    anything fails on the way, so no test leaves it running."""
    try:
        action()
        return proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_node_starts_its_share_lists_the_urls_and_stops_them_on_sigterm(tmp_path):
    base = free_ports(4)
    urls = tmp_path / "shared" / "urls.yaml"
    update_urls(urls, [f"http://node0:{base}", f"http://node0:{base + 1}"], add=True)  # node 0, already up
    ours = [f"http://127.0.0.1:{base + 2}", f"http://127.0.0.1:{base + 3}"]
    proc = _start_node(tmp_path, base, urls)
    pids: dict[int, int] = {}

    def check_and_stop():
        _wait_for(lambda: len(read_urls(urls)) == 4 or proc.poll() is not None, "node 1's URLs in the list")
        assert proc.poll() is None, proc.stderr.read()
        # node 1 of 2 runs servers 2 and 3, on base_port + 2 and + 3, after node 0's entries
        assert read_urls(urls) == [f"http://node0:{base}", f"http://node0:{base + 1}", *ours]
        for url in ours:
            assert requests.get(url + "/health", timeout=10).status_code == 200
        pids.update(_pids(tmp_path))
        assert (tmp_path / "logs" / "sglang_server_2.log").exists() and not _gone(pids[3])
        proc.send_signal(signal.SIGTERM)

    out, err = _ended_after(proc, check_and_stop)
    assert proc.returncode == 0, err
    assert out.splitlines() == [f"- {u}" for u in ours]  # the URLs, printed once healthy
    assert all(_gone(pid) for pid in pids.values())
    for url in ours:
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=10)
    assert read_urls(urls) == [f"http://node0:{base}", f"http://node0:{base + 1}"]  # ours taken out again


def _failure_after(proc: subprocess.Popen, action) -> str:
    """Do `action` to the running command, then wait for it to fail (status 2); its stderr as one line."""
    _, err = _ended_after(proc, action)
    assert proc.returncode == 2, err
    return " ".join(err.split())


def test_a_server_that_exits_ends_the_command_naming_it_and_its_log(tmp_path):
    base = free_ports(4)
    urls = tmp_path / "urls.yaml"
    proc = _start_node(tmp_path, base, urls)
    pids: dict[int, int] = {}

    def kill_server_3():
        _wait_for(lambda: len(read_urls(urls)) == 2 or proc.poll() is not None, "node 1's URLs in the list")
        pids.update(_pids(tmp_path))
        os.kill(pids[3], signal.SIGKILL)

    msg = _failure_after(proc, kill_server_3)
    assert f"SGLang server 3 (http://127.0.0.1:{base + 3}) exited with code -9" in msg
    assert f"full log: {tmp_path / 'logs' / 'sglang_server_3.log'}" in msg
    assert _gone(pids[2]) and read_urls(urls) == []  # the other one stopped, the list emptied


def test_a_server_that_exits_is_started_again_up_to_max_restarts(tmp_path):
    base = free_ports(4)
    urls = tmp_path / "urls.yaml"
    proc = _start_node(tmp_path, base, urls, max_restarts=1, retry_on_other_servers=True)
    url = f"http://127.0.0.1:{base + 3}"

    def kill_server_3_twice():
        _wait_for(lambda: len(read_urls(urls)) == 2 or proc.poll() is not None, "node 1's URLs in the list")
        first = _pids(tmp_path)
        os.kill(first[3], signal.SIGKILL)

        def answers_again() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return _pids(tmp_path)[3] != first[3] and requests.get(url + "/health", timeout=10).status_code == 200
            except (requests.ConnectionError, ValueError):
                return False

        _wait_for(answers_again, "server 3 started again")
        assert _pids(tmp_path)[2] == first[2] and read_urls(urls) == [f"http://127.0.0.1:{base + 2}", url]
        os.kill(_pids(tmp_path)[3], signal.SIGKILL)  # no restart left: the command ends, naming it

    msg = _failure_after(proc, kill_server_3_twice)
    assert f"SGLang server 3 ({url}) exited with code -9; last log line" in msg and "0 restarts left" in msg
    assert msg.count("exited with code -9") == 2  # the first time noted, the second the error
