"""SGLANG_API_KEY: `rlrecipe serve` refuses requests without the bearer key (health checks aside),
as SGLang's --api-key does, and the client sends the key with every request."""

import stat
import sys
from pathlib import Path

import requests

from rlrecipe.modeling import load_tokenizer
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import is_authorized
from rlrecipe.rollout.sglang.engine import SGLangEngine
from rlrecipe.rollout.sglang.server import ServerProcess, sglang_launch_cmd
from rlrecipe.trajectory.record import SamplingParams, Trajectory
from tests.rollout.test_sglang_client import BOOT_TIMEOUT_S, free_ports, rlrecipe_cmd

KEY = "s3cret-key"


def test_who_is_let_in():
    assert is_authorized("/generate", None, None)  # no key set: everyone
    assert is_authorized("/health", None, KEY) and is_authorized("/health_generate", None, KEY)
    assert is_authorized("/generate", f"Bearer {KEY}", KEY)
    assert not is_authorized("/generate", None, KEY)
    assert not is_authorized("/update_weights_from_disk", "Bearer wrong", KEY)
    assert not is_authorized("/generate", KEY, KEY)  # the scheme is part of it


def test_launched_sglang_gets_the_key():
    cfg = SGLangServer()
    assert "--api-key" not in sglang_launch_cmd("m", "h", 1, 0, cfg, "bfloat16", 0)
    cmd = sglang_launch_cmd("m", "h", 1, 0, cfg, "bfloat16", 0, key=KEY)
    assert cmd[cmd.index("--api-key") + 1] == KEY


def test_a_launch_log_names_the_key_by_its_variable_not_its_value(tmp_path):
    server = ServerProcess(0, "http://127.0.0.1:9", [sys.executable, "-c", "pass", "--api-key", KEY],
                           tmp_path / "server.log", key=KEY)
    server.start()
    server.proc.wait(timeout=60)
    server.stop()
    log = (tmp_path / "server.log").read_text()
    assert '-c pass --api-key "$SGLANG_API_KEY"' in log and KEY not in log


def test_a_server_printing_its_key_is_quoted_redacted_and_its_log_kept_private(tmp_path):
    """A server given the key on its command line (SGLang takes it nowhere else) writes it into its
    log (SGLang's line of its arguments): the log is its user's only, and an error quoting its last
    line shows the key redacted."""
    script = "import sys; print(f'server_args=ServerArgs(api_key={sys.argv[2]!r})'); sys.exit(3)"
    server = ServerProcess(0, "http://127.0.0.1:9", [sys.executable, "-c", script, "--api-key", KEY],
                           tmp_path / "server.log", key=KEY)
    server.start()
    server.proc.wait(timeout=60)
    server.stop()
    assert stat.S_IMODE((tmp_path / "server.log").stat().st_mode) == 0o600
    message = str(server.crash_error())
    assert "exited with code 3" in message and "api_key='***'" in message and KEY not in message


def test_a_keyed_server_refuses_strangers_and_serves_the_client(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)  # the launched server and this client both read it
    tok = load_tokenizer(tiny_model_dir)
    base = free_ports(1)
    cfg = SGLangServer(base_port=base, startup_timeout_s=BOOT_TIMEOUT_S,
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path, eos_token_id=tok.eos_token_id)
    url = f"http://127.0.0.1:{base}"
    try:
        # `rlrecipe serve` reads the key from its environment: any local user reads a command line
        assert KEY not in Path(f"/proc/{eng.servers[0].proc.pid}/cmdline").read_bytes().decode()
        assert KEY not in (tmp_path / "sglang_server_0.log").read_text()
        assert requests.get(url + "/health", timeout=30).status_code == 200  # no key needed
        body = {"input_ids": tok.encode("Add 1 and 2."), "sampling_params": {"max_new_tokens": 2}}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(url + "/generate", json=body, headers=headers, timeout=30)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
            r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir)},
                              headers=headers, timeout=30)
            assert r.status_code == 401
        ok = requests.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
        trajs = [Trajectory(uid=f"p{i}", group_id="g", prompt_ids=tok.encode(f"Add {i} and 3.")) for i in range(3)]
        eng.generate(trajs, SamplingParams(max_new_tokens=4))  # the client carries the key
        assert all(t.done and t.response_ids for t in trajs)
        eng.update_weights_from_disk(tiny_model_dir, 1)  # a control endpoint, through the client
    finally:
        eng.close()


def test_the_real_router_in_front_of_keyed_servers(tiny_model_dir, tmp_path, monkeypatch):
    """rollout.sglang.router with SGLANG_API_KEY set: the launched sglang-router (given the key)
    routes the client's keyed requests, and one without the key is refused through it."""
    import pytest

    pytest.importorskip("sglang_router")
    from tests.rollout.test_sglang_client import free_port

    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    tok = load_tokenizer(tiny_model_dir)
    cfg = SGLangServer(base_port=free_ports(2), num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S, router=True,
                       router_port=free_port(),
                       launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}"])
    eng = SGLangEngine.launch(tiny_model_dir, cfg=cfg, dtype="float32", run_dir=tmp_path, eos_token_id=tok.eos_token_id)
    try:
        body = {"input_ids": tok.encode("Add 1 and 2."), "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(eng.router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 401, (r.status_code, r.text[:300])
        trajs = [Trajectory(uid=str(i), prompt_ids=tok.encode("Add 1 and 2.")) for i in range(4)]
        eng.generate(trajs, SamplingParams(max_new_tokens=3), seed=0)
        assert all(t.done and 1 <= len(t.response_ids) <= 3 for t in trajs)
    finally:
        eng.close()
