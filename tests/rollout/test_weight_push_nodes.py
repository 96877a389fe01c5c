"""A disk push reads the shared file system once per node, not once per server (sglang/weights.py).

Servers on three "nodes" (loopback addresses 127.0.0.1 to 127.0.0.3, three servers each) answer
/update_weights_from_disk over HTTP as SGLang does. Each node has a page cache of its own: a load finds
the export there only once a load on the same node has finished reading it (a load under way has not
filled it yet, as a read of 15 GB takes seconds); otherwise it reads the shared file system, which
counts. Pushed through a real ServerFleet and WeightPusher, nine servers cost three reads.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.weights import WeightPusher, node_waves

NODES, PER_NODE = 3, 3
READ_S = 0.3  # one read of the export from the shared file system


class SharedFileSystem:
    def __init__(self):
        self.lock = threading.Lock()
        self.reads: list[tuple[str, str]] = []  # (node, path) per read of the shared file system
        self.cached: dict[str, set[str]] = {}  # per node: exports in its page cache
        self.loads: list[tuple[str, int, float, float]] = []  # (node, port, start, end)

    def load(self, node: str, port: int, path: str) -> None:
        t0 = time.perf_counter()
        with self.lock:
            hit = path in self.cached.setdefault(node, set())
            if not hit:
                self.reads.append((node, path))
        time.sleep(READ_S if not hit else READ_S / 10)
        with self.lock:
            self.cached[node].add(path)
            self.loads.append((node, port, t0, time.perf_counter()))


def _server(fs: SharedFileSystem, host: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/update_weights_from_disk"
            fs.load(host, self.server.server_address[1], body["model_path"])
            out = json.dumps({"success": True, "message": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def fleet_on_three_nodes():
    fs = SharedFileSystem()
    try:
        servers = [_server(fs, f"127.0.0.{n + 1}") for n in range(NODES) for _ in range(PER_NODE)]
    except OSError as err:  # pragma: no cover - a sandbox without the 127/8 loopback range
        pytest.skip(f"loopback addresses beyond 127.0.0.1 unavailable: {err}")
    # the URLs interleave the nodes, as a merged shared/urls.yaml may
    order = [n * PER_NODE + k for k in range(PER_NODE) for n in range(NODES)]
    urls = [f"http://{servers[i].server_address[0]}:{servers[i].server_address[1]}" for i in order]
    fleet = ServerFleet(urls, cfg=SGLangServer())
    yield fs, fleet
    fleet.close()
    for s in servers:
        s.shutdown()
        s.server_close()


def test_node_waves_take_one_server_per_host_first():
    urls = ["http://a:1", "http://b:1", "http://a:2", "http://c:1", "http://b:2", "http://a:3"]
    assert node_waves(urls, list(range(6))) == ([0, 1, 3], [2, 4, 5])
    assert node_waves(urls, [2, 4, 5]) == ([2, 4], [5])  # a node whose first server is out: the next one reads


def test_a_disk_push_reads_the_shared_file_system_once_per_node(fleet_on_three_nodes, tmp_path):
    fs, fleet = fleet_on_three_nodes
    pusher = WeightPusher(fleet, SGLangServer(), None)
    pusher.verify_export = lambda *a, **k: None  # the weight check is tested elsewhere; here, the reads
    for version in (1, 2):
        export = tmp_path / f"v{version:07d}"
        export.mkdir()
        pusher.update_from_disk(export, version)
        reads = [node for node, path in fs.reads if path.endswith(export.name)]
        assert sorted(reads) == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # 3 reads for 9 servers
    assert len(fs.loads) == 2 * NODES * PER_NODE
    assert fleet.version == 2 and fleet.weight_version == ["2"] * NODES * PER_NODE
    # the nodes' first loads run side by side, not one after another
    first = sorted(fs.loads, key=lambda x: x[2])[:NODES]
    assert max(start for *_, start, _ in first) < min(end for *_, end in first)


def test_every_server_reading_at_once_would_cost_one_read_per_server(fleet_on_three_nodes, tmp_path):
    # the counting itself: all nine loads at once (the push before it went node by node) read nine times
    fs, fleet = fleet_on_three_nodes
    from concurrent.futures import ThreadPoolExecutor

    export = tmp_path / "v0000001"
    export.mkdir()
    with ThreadPoolExecutor(max_workers=NODES * PER_NODE) as pool:
        list(pool.map(lambda i: fleet.control(i, "/update_weights_from_disk", {"model_path": str(export)}, 30.0),
                      fleet.live))
    assert len(fs.reads) == NODES * PER_NODE
