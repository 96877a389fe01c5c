"""`rlrecipe data download` / `import` against a local server in the Hugging Face hub URL layout.

The server answers what huggingface_hub's hf_hub_download asks: a HEAD on
/datasets/{repo}/resolve/{revision}/{filename} (headers X-Repo-Commit, ETag, Content-Length),
then a GET of the same URL. Nothing of the code under test is mocked.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlrecipe.core.errors import UserError
from rlrecipe.data.download import check_reachable, download, import_file
from rlrecipe.data.io import read_jsonl
from rlrecipe.data.registry import load_lock

RLRECIPE = Path(sys.executable).parent / "rlrecipe"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40

R1 = "<｜begin▁of▁sentence｜><｜User｜>{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}.<｜Assistant｜><think>\n"


def areal_rl_bytes() -> bytes:
    rows = [
        {"prompt": R1.format(q="What is $2+3$?"), "task": "math", "query_id": "q1", "solutions": ["\\boxed{5}"]},
        {"prompt": R1.format(q="Compute $\\frac{1}{2}+\\frac{1}{2}$."), "task": "math", "query_id": "q2",
         "solutions": ["\\boxed{1}", "1"]},
        {"prompt": R1.format(q="Write a sorting function."), "task": "code", "query_id": "c1", "solutions": ["x"]},
        {"prompt": R1.format(q="No answer here."), "task": "math", "query_id": "q3", "solutions": []},
    ]
    return ("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n").encode()


def aime_parquet_bytes() -> bytes:
    table = pa.table({"id": [60, 61], "problem": ["Find $x$ if $x+1=3$.", "Find $y$ if $2y=8$."],
                      "solution": ["x = \\boxed{2}", "y=4"], "answer": ["2", "4"], "url": ["u", "u"],
                      "year": ["2024", "2024"]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


class FakeHub:
    """Serves {(repo, filename): bytes} for any revision; X-Repo-Commit is the revision if it is a
    commit sha, else `self.commit`. `self.requests` logs (method, path)."""

    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}
        self.commit = COMMIT_A
        self.hub_headers = True  # False: behave like a plain web server (no X-Repo-Commit)
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _resolve(self):
                hub.requests.append((self.command, self.path))
                path = unquote(self.path.split("?")[0])
                if not path.startswith("/datasets/") or "/resolve/" not in path:
                    return None, None
                repo, rest = path[len("/datasets/"):].split("/resolve/", 1)
                revision, filename = rest.split("/", 1)
                commit = revision if len(revision) == 40 else hub.commit
                return commit, hub.files.get((repo, filename))

            def _headers(self, commit, body):
                if body is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return False
                self.send_response(200)
                if hub.hub_headers:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return True

            def do_HEAD(self):
                self._headers(*self._resolve())

            def do_GET(self):
                commit, body = self._resolve()
                if self._headers(commit, body):
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        # huggingface_hub reads HF_HUB_OFFLINE once, at import (another test may have imported it).
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(var, raising=False)
        yield server


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def write_registry(path: Path, **entries) -> Path:
    path.write_text(yaml.safe_dump(entries))
    return path


# --- download ------------------------------------------------------------------------------------

def test_download_converts_areal_rl_and_records_lock(hub, tmp_path):
    hub.files[("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")] = areal_rl_bytes()
    result = download("boba-106k", dest=tmp_path)

    out = tmp_path / "boba-106k" / "rl.jsonl"
    assert result.out_path == out
    rows = read_jsonl(out, "rl")
    assert rows == [{"id": "q1", "prompt": "What is $2+3$?", "answers": ["5"],
                     "raw_prompt": R1.format(q="What is $2+3$?")},
                    {"id": "q2", "prompt": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "answers": ["1"],
                     "raw_prompt": R1.format(q="Compute $\\frac{1}{2}+\\frac{1}{2}$.")}]
    report = result.report
    assert (report.total, report.kept, report.rejected) == (4, 2, 2)
    assert report.converted == 2
    assert any("not math" in r for r in report.reasons)

    # HEAD + GET went to our server at the registry's revision.
    assert ("HEAD", "/datasets/inclusionAI/AReaL-boba-Data/resolve/main/AReaL-boba-106k.jsonl") in hub.requests
    assert any(m == "GET" for m, _ in hub.requests)

    lock = load_lock(tmp_path)
    record = lock["boba-106k@main"]
    assert record["commit"] == COMMIT_A
    assert record["sha256"] == hashlib.sha256(areal_rl_bytes()).hexdigest()
    assert result.lock_recorded == tmp_path / "checksums.lock"
    source = json.loads((tmp_path / "boba-106k" / "source.json").read_text())
    assert source["commit"] == COMMIT_A and source["rows_kept"] == 2
    # a download names the hub file it fetched; no pin and no lock yet, so nothing verified it
    assert source["imported"] is False and source["repo"] == "inclusionAI/AReaL-boba-Data"
    assert source["sha256_verified_against"] is None
    # No temp files left behind next to the outputs.
    assert not [p for p in (tmp_path / "boba-106k").iterdir() if p.name.startswith(".")]


def test_second_download_uses_locked_commit_and_refuses_changed_file(hub, tmp_path):
    repo_file = ("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")
    hub.files[repo_file] = areal_rl_bytes()
    download("boba-106k", dest=tmp_path)
    good = (tmp_path / "boba-106k" / "rl.jsonl").read_bytes()

    # Upstream "main" moves on; a fresh machine (no cache, committed lock file) still fetches the
    # locked commit, and the mirror now serves different bytes there: refused.
    hub.commit = COMMIT_B
    hub.files[repo_file] = areal_rl_bytes().replace(b"\\\\boxed{5}", b"\\\\boxed{6}")
    import shutil

    shutil.rmtree(tmp_path / ".cache")
    hub.requests.clear()
    with pytest.raises(UserError, match="differs from .* recorded .* at first download") as err:
        download("boba-106k", dest=tmp_path)
    assert "boba-106k@main" in str(err.value)
    assert all(f"/resolve/{COMMIT_A}/" in p for _, p in hub.requests)
    assert (tmp_path / "boba-106k" / "rl.jsonl").read_bytes() == good
    assert load_lock(tmp_path)["boba-106k@main"]["commit"] == COMMIT_A


def test_registry_pinned_sha256_mismatch_is_refused_and_keeps_good_files(hub, tmp_path):
    hub.files[("org/aime", "data/train.parquet")] = aime_parquet_bytes()
    registry = write_registry(tmp_path / "registry.yaml", aime24={
        "repo": "org/aime", "repo_type": "dataset", "filename": "data/train.parquet", "revision": COMMIT_A,
        "sha256": "0" * 64, "kind": "eval", "format": "eval"})
    previous = tmp_path / "aime24" / "eval.jsonl"
    previous.parent.mkdir(parents=True)
    previous.write_text('{"id": "1", "problem": "p", "answer": "1"}\n')
    with pytest.raises(UserError, match="does not match .* pinned for 'aime24'"):
        download("aime24", dest=tmp_path, registry_path=registry)
    assert previous.read_text() == '{"id": "1", "problem": "p", "answer": "1"}\n'
    assert sorted(p.name for p in (tmp_path / "aime24").iterdir()) == ["eval.jsonl"]
    assert not (tmp_path / "checksums.lock").exists()


def test_pinned_sha256_match_downloads_parquet_eval(hub, tmp_path):
    body = aime_parquet_bytes()
    hub.files[("org/aime", "data/train.parquet")] = body
    registry = write_registry(tmp_path / "registry.yaml", aime={
        "repo": "org/aime", "repo_type": "dataset", "filename": "data/train.parquet", "revision": COMMIT_A,
        "sha256": hashlib.sha256(body).hexdigest(), "kind": "eval", "format": "eval"})
    result = download("aime", dest=tmp_path / "data", registry_path=registry)
    assert result.commit == COMMIT_A
    assert read_jsonl(result.out_path, "eval") == [
        {"id": "60", "problem": "Find $x$ if $x+1=3$.", "answer": "2"},
        {"id": "61", "problem": "Find $y$ if $2y=8$.", "answer": "4"}]


def test_missing_file_on_hub_is_one_clear_error(hub, tmp_path):
    with pytest.raises(UserError, match="AReaL-boba-SFT-200.jsonl not found in inclusionAI/AReaL-boba-Data"):
        download("boba-200", dest=tmp_path)
    assert not (tmp_path / "boba-200").exists()


def test_endpoint_that_is_not_a_hub_is_one_clear_error(hub, tmp_path):
    hub.hub_headers = False
    hub.files[("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")] = areal_rl_bytes()
    start = time.monotonic()
    with pytest.raises(UserError, match="X-Repo-Commit.*HF_ENDPOINT.*rlrecipe data import FILE --as boba-106k"):
        download("boba-106k", dest=tmp_path / "data")
    assert time.monotonic() - start < 10
    assert not (tmp_path / "data" / "boba-106k").exists()


def test_unknown_name_lists_registry(tmp_path):
    with pytest.raises(UserError, match="no dataset named 'nope'.*boba-106k"):
        download("nope", dest=tmp_path)


def test_offline_fails_fast_with_guidance_and_leaves_no_files(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        download("boba-106k", dest=tmp_path / "data")
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "unreachable" in message and "HF_ENDPOINT" in message
    assert "rlrecipe data import FILE --as boba-106k" in message
    assert files_under(tmp_path) == []


def test_hf_hub_offline_env_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        download("aime25", dest=tmp_path)
    assert files_under(tmp_path) == []


def test_offline_after_download_reuses_cache(hub, tmp_path, monkeypatch):
    hub.files[("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")] = areal_rl_bytes()
    download("boba-106k", dest=tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url())
    result = download("boba-106k", dest=tmp_path)
    assert any("using the cached file" in n for n in result.notes)
    assert result.report.kept == 2


def test_check_reachable(hub):
    assert check_reachable(hub.url) is None
    assert "cannot connect" in check_reachable(closed_port_url(), timeout=1)
    assert "not an http(s) URL" in check_reachable("ftp://example.org")


# --- import --------------------------------------------------------------------------------------

def test_import_registered_name_checks_lock_sha(tmp_path, hub):
    hub.files[("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")] = areal_rl_bytes()
    download("boba-106k", dest=tmp_path)  # records the sha256 in the lock
    same = tmp_path / "same.jsonl"
    same.write_bytes(areal_rl_bytes())
    assert import_file(same, "boba-106k", dest=tmp_path).report.kept == 2

    other = tmp_path / "other.jsonl"
    other.write_bytes(areal_rl_bytes() + areal_rl_bytes())
    with pytest.raises(UserError, match="does not match .* recorded in .*checksums.lock.*--as boba-106k-local"):
        import_file(other, "boba-106k", dest=tmp_path)


AIME25 = Path(__file__).parents[1] / "data" / "aime25_test.jsonl"


def test_import_records_path_and_sha_and_never_claims_the_hub_pin(tmp_path):
    # AReaL's public copy of AIME 2025 has the sha256 pinned for aime25 in the shipped registry.
    result = import_file(AIME25, "aime25", dest=tmp_path)
    source = json.loads((tmp_path / "aime25" / "source.json").read_text())
    assert source["via"] == "import" and source["imported"] is True
    assert source["source_path"] == str(AIME25.resolve())
    assert source["sha256"] == result.sha256 == hashlib.sha256(AIME25.read_bytes()).hexdigest()
    assert source["size"] == 15813 and source["sha256_verified_against"] == "registry"
    assert not {"repo", "filename", "revision", "commit", "endpoint"} & set(source)
    assert len(read_jsonl(tmp_path / "aime25" / "eval.jsonl", "eval")) == 30

    # any other file under that name is refused against the pin; under a new name it is unverified
    other = tmp_path / "aime25-edited.jsonl"
    other.write_bytes(AIME25.read_bytes().replace(b'"answer": 70', b'"answer": 71'))
    with pytest.raises(UserError, match="does not match b4e273c0.* pinned in .*registry.yaml"):
        import_file(other, "aime25", dest=tmp_path)
    import_file(other, "aime25-local", kind="eval", dest=tmp_path)
    local = json.loads((tmp_path / "aime25-local" / "source.json").read_text())
    assert local["imported"] is True and local["sha256_verified_against"] is None


def test_import_new_name_needs_kind_and_converts_sft(tmp_path):
    raw = tmp_path / "sft.json"
    raw.write_text(json.dumps([
        {"prompt": R1.format(q="Add 1 and 2."), "answer": "Adding gives 3.</think>\n\\boxed{3}<｜end▁of▁sentence｜>"},
        {"prompt": "", "answer": "x"},
    ]))
    with pytest.raises(UserError, match="pass --kind"):
        import_file(raw, "my-sft", dest=tmp_path / "data")
    result = import_file(raw, "my-sft", kind="sft", dest=tmp_path / "data")
    rows = read_jsonl(tmp_path / "data" / "my-sft" / "sft.jsonl", "sft")
    assert rows == [{"id": "my-sft-1", "prompt": "Add 1 and 2.", "response": "Adding gives 3.</think>\n\\boxed{3}",
                     "raw_prompt": R1.format(q="Add 1 and 2."),
                     "raw_response": "Adding gives 3.</think>\n\\boxed{3}<｜end▁of▁sentence｜>"}]
    assert (result.report.kept, result.report.rejected) == (1, 1)


def test_import_rejects_bad_name_and_kind_mismatch(tmp_path):
    raw = tmp_path / "x.jsonl"
    raw.write_text('{"problem": "p", "answer": 3}\n')
    with pytest.raises(UserError, match="must be letters"):
        import_file(raw, "../evil", kind="eval", dest=tmp_path)
    with pytest.raises(UserError, match="registered .* as kind 'rl', not 'eval'"):
        import_file(raw, "boba-106k", kind="eval", dest=tmp_path)


def test_import_with_no_usable_rows_writes_nothing(tmp_path):
    raw = tmp_path / "bad.jsonl"
    raw.write_text('{"problem": "p"}\nnot json\n')
    with pytest.raises(UserError, match="no usable eval rows .*line 1: no answer field"):
        import_file(raw, "broken", kind="eval", dest=tmp_path / "data")
    assert files_under(tmp_path / "data") == []


# --- CLI -----------------------------------------------------------------------------------------

def run_cli(*args, env=None):
    full_env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}
    for var in ("HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        full_env.pop(var, None)
    return subprocess.run([str(RLRECIPE), "data", *args], capture_output=True, text=True, env=full_env, timeout=60)


def test_cli_download_offline_single_error_line_exit_2(tmp_path):
    start = time.monotonic()
    proc = run_cli("download", "boba-106k", "--dest", str(tmp_path / "data"), env={"HF_ENDPOINT": closed_port_url()})
    assert time.monotonic() - start < 20
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stdout + proc.stderr
    assert "HF_ENDPOINT" in lines[0] and "rlrecipe data import" in lines[0]
    assert files_under(tmp_path) == []


def test_cli_download_and_import_print_counts(hub, tmp_path):
    hub.files[("inclusionAI/AReaL-boba-Data", "AReaL-boba-106k.jsonl")] = areal_rl_bytes()
    proc = run_cli("download", "boba-106k", "--dest", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    assert "kept:      2" in proc.stdout and "rejected:  2" in proc.stdout
    assert "converted: 2" in proc.stdout

    raw = tmp_path / "aime.parquet"
    raw.write_bytes(aime_parquet_bytes())
    proc = run_cli("import", str(raw), "--as", "my-aime", "--kind", "eval", "--dest", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    assert "kept:      2" in proc.stdout
    assert read_jsonl(tmp_path / "data" / "my-aime" / "eval.jsonl", "eval")[0]["answer"] == "2"
