"""A weight push that meets a server that is down (sglang/down.py): with retry_on_other_servers it is
left out and the push goes on to the others; without it, or when the server answered with a
failure (weights refused), the push stops naming the server.

One fake SGLang server answers /health, /server_info and every push endpoint as SGLang does (or
refuses the weights); the other URL is a port nothing listens on (a node that is gone)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import torch

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.tensor_push import push_tensors
from rlrecipe.rollout.sglang.weights import WeightPusher
from rlrecipe.rollout.weights.adapter import Adapter
from tests.rollout.test_sglang_client import free_port


class FakeServer:
    """Answers as an SGLang server of `version` (0.5.4: no weight-update session; from 0.5.21 one is
    begun and ended around a push); `refuse`: pushes fail."""

    def __init__(self, refuse: bool = False, version: str = "0.5.4"):
        self.posted: list[tuple[str, str | None]] = []  # (path, weight_version)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: dict, code: int = 200):
                out = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self):
                if self.path == "/server_info":
                    self._answer({"version": version, "tp_size": 1})
                else:
                    self._answer({})  # /health

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posted.append((self.path, body.get("weight_version")))
                session = self.path.endswith("_weight_update")  # not refused: only the weights are
                self._answer({"success": session or not refuse, "message": "shape mismatch" if refuse else "ok"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fleet_of(request):
    made = []

    def make(urls: list[str], retry: bool) -> ServerFleet:
        made.append(ServerFleet(urls, cfg=SGLangServer(retry_on_other_servers=retry)))
        return made[-1]

    yield make
    for fleet in made:
        fleet.close()


PUSHES = {"disk": "/update_weights_from_disk", "tensor": "/update_weights_from_tensor",
          "adapter": "/load_lora_adapter", "handle": "/update_weights_from_tensor"}


def _push(fleet: ServerFleet, how: str, version: int) -> None:
    pusher = WeightPusher(fleet, fleet.cfg, None)
    if how == "disk":
        pusher.update_from_disk("/exports/step", version, verify=False)
    elif how == "adapter":  # trainer.lora with weight_sync disk: the adapter's PEFT directory
        pusher.update_adapter(Adapter({}, {}, Path(f"/exports/adapter_{version}")), version, verify=False)
    elif how == "handle":  # weight_sync ipc: rank 0 posts each bucket's handles, a trainer rank per server GPU
        ranks = len(fleet.urls)
        with pusher.handles_pushed(version, world_size=ranks) as send:
            send([f"bucket-0-rank-{r}" for r in range(ranks)], False)
            send([f"bucket-1-rank-{r}" for r in range(ranks)], True)
    else:
        push_tensors(fleet, {"w": torch.arange(4.0)}, version)


def _pushes(server: FakeServer, how: str) -> int:
    return sum(path == PUSHES[how] for path, _ in server.posted)


@pytest.mark.parametrize("how", PUSHES)
def test_with_retry_a_down_server_is_left_out_and_the_push_reaches_the_others(fleet_of, how):
    up, gone = FakeServer(), f"http://127.0.0.1:{free_port()}"
    try:
        fleet = fleet_of([gone, up.url], retry=True)
        _push(fleet, how, 3)
        assert fleet.live == [1] and fleet.failed == {0} and fleet.left_out_count == 1
        assert fleet.metrics()["rollout_servers_live"] == 1
        assert _pushes(up, how) >= 1  # the live server got the whole push
        before = _pushes(up, how)
        _push(fleet, how, 4)  # the next push goes to the live server only
        assert fleet.live == [1] and _pushes(up, how) > before
    finally:
        up.close()


@pytest.mark.parametrize("how", PUSHES)
def test_without_retry_a_down_server_stops_the_push_naming_it(fleet_of, how):
    up, gone = FakeServer(), f"http://127.0.0.1:{free_port()}"
    try:
        fleet = fleet_of([gone, up.url], retry=False)
        with pytest.raises(UserError, match=gone):
            _push(fleet, how, 3)
        assert fleet.live == [0, 1]
    finally:
        up.close()


@pytest.mark.parametrize("how", PUSHES)
def test_a_server_that_refuses_the_weights_stops_the_push_even_with_retry(fleet_of, how):
    refusing, up = FakeServer(refuse=True), FakeServer()
    try:
        fleet = fleet_of([refusing.url, up.url], retry=True)
        with pytest.raises(UserError, match="shape mismatch"):
            _push(fleet, how, 3)
        assert fleet.live == [0, 1] and fleet.left_out_count == 0  # it answers: not taken for down
    finally:
        refusing.close()
        up.close()


@pytest.mark.parametrize("how", ["tensor", "handle"])
def test_a_server_gone_before_its_weight_update_session_begins_is_left_out(fleet_of, how):
    """SGLang >= 0.5.21 pushes tensors inside a session: a node lost between two steps fails the
    /begin_weight_update (its /server_info was known from before)."""
    up, gone = FakeServer(version="0.5.21"), f"http://127.0.0.1:{free_port()}"
    try:
        fleet = fleet_of([gone, up.url], retry=True)
        fleet.server_infos[0] = {"version": "0.5.21", "tp_size": 1}  # answered before it was lost
        _push(fleet, how, 3)
        assert fleet.live == [1] and fleet.left_out_count == 1
        paths = [path for path, _ in up.posted]
        assert paths[0] == "/begin_weight_update" and paths[-1] == "/end_weight_update"
        assert paths.count(PUSHES[how]) >= 1 and paths.count("/begin_weight_update") == 1
    finally:
        up.close()


def test_the_last_live_server_down_stops_the_push(fleet_of):
    gone = f"http://127.0.0.1:{free_port()}"
    fleet = fleet_of([gone], retry=True)
    with pytest.raises(UserError, match="no SGLang server left to retry on"):
        _push(fleet, "disk", 3)


@pytest.fixture
def attached_broadcast(tiny_model_dir, tmp_path, monkeypatch):
    """Two `rlrecipe serve` servers launched by one engine, and an engine attached to them (the run
    did not launch them, so it learns of a death only through a request) that pushes by broadcast
    (gloo) with retry_on_other_servers: (launched, attached)."""
    from rlrecipe.modeling import load_tokenizer
    from rlrecipe.rollout.sglang.engine import SGLangEngine
    from tests.rollout.test_sglang_client import BOOT_TIMEOUT_S, free_ports, rlrecipe_cmd

    monkeypatch.setenv("SGLANG_API_KEY", "shared-key")  # a key of its own would keep the attached engine out
    tok = load_tokenizer(tiny_model_dir)
    launched = SGLangEngine.launch(tiny_model_dir, dtype="float32", run_dir=tmp_path, cfg=SGLangServer(
        base_port=free_ports(2), num_servers=2, startup_timeout_s=BOOT_TIMEOUT_S,
        launch_cmd=[*rlrecipe_cmd(), "serve", "{model}", "--host", "{host}", "--port", "{port}", "--dtype", "{dtype}"]))
    cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=free_port(),
                       retry_on_other_servers=True)
    eng = SGLangEngine(launched.urls, cfg=cfg, eos_token_id=tok.eos_token_id, served_dtype="float32")
    try:
        yield launched, eng
    finally:
        eng.close()
        launched.close()


def _kill(server) -> None:
    server.proc.kill()
    server.proc.wait(timeout=30)


def _push_then_serves(eng, model_dir, state: dict, version: int) -> None:
    """Push `state` as `version` (within a guard against a stalled push); server 0 is left, holds it
    and samples with it: its log-probs are the model's own."""
    from rlrecipe.modeling import load_model, load_tokenizer
    from rlrecipe.trajectory.record import SamplingParams
    from tests.rollout.test_sglang_client import prompts, recompute
    from tests.rollout.test_sglang_hang import within_guard

    within_guard(lambda: eng.update_weights_from_state(state, version))
    assert eng.live == [0] and eng.fleet.left_out_count == 1
    assert eng.model_info(0)["weight_version"] == str(version)
    model = load_model(model_dir)
    model.load_state_dict(state)
    trajs = eng.generate(prompts(load_tokenizer(model_dir), 4), SamplingParams(max_new_tokens=6), seed=2)
    assert (torch.cat([recompute(model, t) - torch.tensor(t.logp_infer) for t in trajs])).abs().max() < 1e-4


@pytest.mark.slow
def test_a_broadcast_push_meeting_an_attached_server_that_is_gone_is_made_again_without_it(
        attached_broadcast, other_model_dir):
    """Server 1 is killed between two pushes: the second leaves it out and reaches server 0 in a
    group made again without it."""
    from rlrecipe.modeling import load_model

    launched, eng = attached_broadcast
    other = load_model(other_model_dir)
    eng.update_weights_from_state(other.state_dict(), 1)
    _kill(launched.servers[1])
    _push_then_serves(eng, other_model_dir, {k: v * 1.05 for k, v in other.state_dict().items()}, 2)


@pytest.mark.slow
@pytest.mark.parametrize("retry", [True, False])
def test_a_server_down_when_the_broadcast_group_is_made_again_is_found_before_the_rendezvous(
        attached_broadcast, other_model_dir, retry):
    """The group is to be made again (a member left out or taken back since the last push) and
    server 1 is down: the rendezvous would wait for it until its timeout. With retry it is left out
    first and the group made without it; without, the push stops naming it."""
    from rlrecipe.modeling import load_model
    from tests.rollout.test_sglang_hang import within_guard

    launched, eng = attached_broadcast
    other = load_model(other_model_dir)
    eng.update_weights_from_state(other.state_dict(), 1)
    _kill(launched.servers[1])
    eng.weights.broadcast.members_changed()
    moved = {k: v * 1.05 for k, v in other.state_dict().items()}
    if retry:
        _push_then_serves(eng, other_model_dir, moved, 2)
        return
    eng.fleet.cfg.retry_on_other_servers = False
    with pytest.raises(UserError, match="the weight update group cannot be made with it") as down:
        within_guard(lambda: eng.update_weights_from_state(moved, 2))
    assert launched.urls[1] in str(down.value)


@pytest.mark.slow
def test_a_server_lost_in_the_middle_of_a_broadcast_stops_the_push_at_once_saying_to_resume(
        attached_broadcast, other_model_dir, monkeypatch):
    """Server 1 is killed once both servers took the push's /update_weights_from_distributed and
    wait in its collective, before the trainer broadcasts. Server 0 is left waiting in that
    collective, so the push cannot be made again without server 1 (tried: it hung until the
    collective's timeout): it fails at once, naming server 1 and saying to resume."""
    import time

    from rlrecipe.modeling import load_model
    from rlrecipe.rollout.sglang import broadcast as broadcast_module
    from tests.rollout.test_sglang_hang import within_guard

    launched, eng = attached_broadcast
    other = load_model(other_model_dir)
    eng.update_weights_from_state(other.state_dict(), 1)
    sent, lost = broadcast_module.broadcast, []

    def lose_server_1_first(group, tensors):
        if not lost:
            time.sleep(1.0)  # the requests are in flight: both servers are waiting in the collective
            _kill(launched.servers[1])
            lost.append(True)
        return sent(group, tensors)

    monkeypatch.setattr(broadcast_module, "broadcast", lose_server_1_first)
    moved = {k: v * 1.05 for k, v in other.state_dict().items()}
    with pytest.raises(UserError, match="stopped part-way") as cut:
        within_guard(lambda: eng.update_weights_from_state(moved, 2))
    assert lost and launched.urls[1] in str(cut.value) and "--resume" in str(cut.value)
    assert eng.fleet.left_out_count == 0  # not made again without it
