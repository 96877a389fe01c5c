"""The push by handle (weight_sync: ipc): buckets shared by file name open in another process with
their values, the request carries names, not bytes, every trainer rank's payload reaches the server
rank on its GPU, and a failure on rank 0 fails every rank.

This file is also the 2-rank worker: torchrun runs it with a JSON spec as its argument.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlrecipe.rollout.weights.handles import HostMirror, SharedBucket, ranks_read_by
from tests.helpers import run_bounded


def weights(rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, as a model's parameters and buffers are; each rank's differ, so a test can tell
    whose arrived."""
    g = torch.Generator().manual_seed(10 + rank)
    return [("a.weight", torch.randn(256, 1024, generator=g)),  # 1 MiB
            ("a.bias", torch.randn(1024, generator=g)),
            ("b.weight", torch.randn(64, 32, generator=g).to(torch.bfloat16)),
            ("steps", torch.arange(5) + 100 * rank)]


# run in another process: the stand-in's reader opens the payload and saves what it found
READ_ELSEWHERE = """
import json, sys
from safetensors.torch import save_file
from rlrecipe.serve.tensors import read_named_tensors
named, files = read_named_tensors({"serialized_named_tensors": [sys.stdin.read()], "load_format": None})
save_file({n: t.contiguous() for n, t in named}, sys.argv[1])
del named  # as a server drops what it loaded: the mapping's reference goes
print(json.dumps(files))
"""


def shared_files() -> list[str]:
    """This process's shared-memory files (torch names them torch_<pid>_...)."""
    import os

    return [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")]


def test_a_bucket_shared_by_file_name_opens_in_another_process_with_its_values(tmp_path):
    named = weights()
    bucket = SharedBucket(named)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert bucket.nbytes == total
    assert len(bucket.payload) < 4096 < total  # names of memory, not the bytes
    out = subprocess.run([sys.executable, "-c", READ_ELSEWHERE, str(tmp_path / "got.safetensors")],
                         input=bucket.payload, capture_output=True, text=True, check=True, timeout=120)
    files = json.loads(out.stdout)
    assert len(files) == 3 and all(f.startswith("/torch_") for f in files)  # one shared file per dtype
    got = load_file(str(tmp_path / "got.safetensors"))
    assert set(got) == {n for n, _ in named}
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert len(shared_files()) == 3
    del bucket  # read once and dropped by both sides: nothing is left in /dev/shm
    assert shared_files() == []


def test_the_host_mirror_keeps_its_buffers_from_one_push_to_the_next():
    mirror = HostMirror()
    mirror.copy(weights(0)[:2])
    mirror.copy(weights(0)[2:])  # a push's buckets, one after another
    first = mirror.finish()
    assert all(torch.equal(first[n], t) for n, t in weights(0))
    buffers = {n: t.data_ptr() for n, t in first.items()}
    mirror.copy(weights(1))
    second = mirror.finish()
    assert {n: t.data_ptr() for n, t in second.items()} == buffers  # written again, not allocated again
    assert all(torch.equal(second[n], t) for n, t in weights(1))


def test_a_payload_sharing_by_file_descriptor_is_refused_by_name():
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp
    from torch.multiprocessing import reductions  # noqa: F401 - registers torch's reducers

    from rlrecipe.serve.tensors import BadTensors, read_named_tensors

    assert mp.get_sharing_strategy() == "file_descriptor"
    t = torch.zeros(4).share_memory_()
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("x", t)])
    body = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "load_format": None}
    with pytest.raises(BadTensors, match="file descriptor cannot reach another process"):
        read_named_tensors(body)


def test_each_server_rank_reads_the_trainer_rank_on_its_gpu_once():
    # colocated: 8 ranks, servers of tp 2 on GPUs 0-1, 2-3, ...
    assert [ranks_read_by(i, 2, 8) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ranks_read_by(1, 4, 8) == [4, 5, 6, 7]
    # a payload read twice would give back two references for the one its pickling took
    with pytest.raises(ValueError, match="ranks read trainer ranks 2-3, and the trainer has 2"):
        ranks_read_by(1, 2, 2)


# as SGLang's receiving side does (utils/patch_torch.py): a CUDA handle's device named by UUID is
# mapped to this process's index of that GPU
READ_CUDA_ELSEWHERE = """
import base64, json, pickle, sys
import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions
original, seen = reductions.rebuild_cuda_tensor, []
def by_uuid(*args):
    seen.append(type(args[6]).__name__)
    index = next(i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return original(*args[:6], index, *args[7:])
reductions.rebuild_cuda_tensor = by_uuid
named = pickle.loads(base64.b64decode(sys.stdin.read()))
save_file({n: t.to("cpu").contiguous() for n, t in named}, sys.argv[1])
print(json.dumps(sorted(set(seen))))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA IPC handle needs a GPU")
def test_a_bucket_on_the_gpu_opens_in_another_process_by_the_devices_uuid(tmp_path):
    named = [(n, t.cuda()) for n, t in weights()]
    bucket = SharedBucket(named)  # kept alive (the sender must be) until the other process has read it
    assert len(bucket.payload) < 4096
    out = subprocess.run([sys.executable, "-c", READ_CUDA_ELSEWHERE, str(tmp_path / "got.safetensors")],
                         input=bucket.payload, capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.splitlines()[-1]) == ["str"]  # the device travelled as its UUID
    got = load_file(str(tmp_path / "got.safetensors"))
    for name, t in weights():
        assert torch.equal(got[name], t), name
    mirror = HostMirror()  # rank 0's copy for the verification: pinned, complete once finished
    mirror.copy(bucket.views)
    host = mirror.finish()
    assert all(host[n].is_pinned() and torch.equal(host[n], t) for n, t in weights())
    del bucket, named
    torch.cuda.ipc_collect()  # the blocks the other process held go back to this one now


# -- two real ranks ----------------------------------------------------------------------------------
def worker(spec: dict) -> None:
    """Under torchrun, 2 ranks over gloo: push each rank's weights by handle; rank 0's `send` opens every
    payload as a server would and records what each rank's held."""
    import torch.distributed as dist

    from rlrecipe.rollout.weights.handle_push import push_by_handles
    from rlrecipe.serve.tensors import read_named_tensors

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(spec["out"])
    sent: list[dict] = []

    def send(payloads: list[str], last: bool) -> None:
        if len(sent) == spec.get("fail_at", -1):
            raise RuntimeError("server refused the bucket")
        seen = {}
        for r, payload in enumerate(payloads):
            named, files = read_named_tensors({"serialized_named_tensors": [payload], "load_format": None})
            seen[r] = {"names": [n for n, _ in named], "files": files}
            save_file({n: t.contiguous() for n, t in named}, str(out / f"bucket{len(sent)}-rank{r}.safetensors"))
        sent.append({"last": last, "ranks": seen})

    try:
        pushed = push_by_handles(iter(weights(rank)), spec["bucket_bytes"], send if rank == 0 else None)
        result = {"pushed": sorted(pushed), "sent": sent, "left_in_shm": shared_files()}
        if rank == 0:
            save_file({n: t.contiguous() for n, t in pushed.items()}, str(out / "pushed.safetensors"))
    except RuntimeError as err:
        result = {"raised": str(err)}
    except SystemExit as err:
        result = {"exit": err.code}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _two_ranks(spec: dict) -> list[dict]:
    run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                 __file__, json.dumps(spec)])
    return [json.loads((Path(spec["out"]) / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_every_ranks_handles_reach_rank_zero_bucket_by_bucket(tmp_path):
    r0, r1 = _two_ranks({"out": str(tmp_path), "bucket_bytes": 1 << 20})
    # 1 MiB buckets: the 1 MiB weight alone, then the rest together; only the second is the last
    assert [b["last"] for b in r0["sent"]] == [False, True]
    assert [b["ranks"]["0"]["names"] for b in r0["sent"]] == [["a.weight"], ["a.bias", "b.weight", "steps"]]
    assert r1 == {"pushed": [], "sent": [], "left_in_shm": []}
    assert r0["left_in_shm"] == []  # every bucket's files went once the server side had read them
    for k in (0, 1):
        names = r0["sent"][k]["ranks"]["0"]["names"]
        for r in (0, 1):
            got = load_file(str(tmp_path / f"bucket{k}-rank{r}.safetensors"))
            assert all(torch.equal(got[n], dict(weights(r))[n]) for n in names), (k, r)  # rank r's own
        files = [set(r0["sent"][k]["ranks"][str(r)]["files"]) for r in (0, 1)]
        assert files[0] and files[1] and not files[0] & files[1]  # each rank shares its own memory
    pushed = load_file(str(tmp_path / "pushed.safetensors"))  # rank 0 keeps what it pushed, to verify
    assert sorted(pushed) == r0["pushed"] and all(torch.equal(pushed[n], t) for n, t in weights(0))


@pytest.mark.slow
def test_a_bucket_the_server_refuses_fails_every_rank(tmp_path):
    r0, r1 = _two_ranks({"out": str(tmp_path), "bucket_bytes": 1 << 20, "fail_at": 1})
    assert r0 == {"raised": "server refused the bucket"} and r1 == {"exit": 1}


if __name__ == "__main__":
    from rlrecipe.train.launch import end_process

    worker(json.loads(sys.argv[1]))
    end_process(0)
