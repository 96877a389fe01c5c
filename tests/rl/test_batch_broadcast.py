"""The graded batch as arrays: packing keeps every value, 2 real gloo ranks receive rank 0's arrays,
and an error on rank 0 stops the other rank quietly.

This file is also the 2-rank worker: torchrun runs it with a JSON spec as its argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlrecipe.trajectory.arrays import TrajectoryBatch, pack_trajectories, unpack_trajectories
from rlrecipe.trajectory.record import Status, Trajectory
from tests.helpers import run_bounded

CHUNK_BYTES = 7  # a staging buffer that splits every array at odd byte offsets


def graded_trajectories() -> list[Trajectory]:
    """A small graded batch with the awkward cases: an empty response, token ids past int16, log-probs
    float32 must round, rewards that are not whole, one trajectory never graded correct/wrong."""
    g = np.random.default_rng(11)
    out = []
    for i, n in enumerate([5, 0, 17, 1, 40]):
        out.append(Trajectory(uid=f"p{i // 2}#{i % 2}", prompt_ids=g.integers(0, 152064, 3 + i).tolist(),
                              group_id=f"p{i // 2}", answers=["7"], response_ids=g.integers(0, 152064, n).tolist(),
                              logp_infer=(-g.random(n) * 9).tolist(), versions=g.integers(0, 6, n).tolist(),
                              status=[Status.FINISHED, Status.TRUNCATED][i % 2], reward=[5.0, -5.0, 0.25][i % 3],
                              correct=None if i == 4 else bool(i % 2 == 0), meta={"i": i}))
    return out


def _as_float32(xs: list[float]) -> list[float]:
    return [float(np.float32(x)) for x in xs]


def assert_batch_holds(batch: TrajectoryBatch, trajs: list[Trajectory]) -> None:
    """Every trainer-side value of `batch` equals the Trajectory objects' own, log-probs as float32."""
    assert len(batch) == len(trajs)
    assert batch.uids == [t.uid for t in trajs] and batch.group_ids == [t.group_id for t in trajs]
    assert batch.rewards == [t.reward for t in trajs]
    assert batch.correct == [t.correct for t in trajs]
    assert batch.statuses == [t.status for t in trajs]
    assert batch.response_lengths == [len(t.response_ids) for t in trajs]
    for i, t in enumerate(trajs):
        assert batch.prompt_ids(i).tolist() == t.prompt_ids and batch.prompt_length(i) == len(t.prompt_ids)
        assert batch.response_ids(i).tolist() == t.response_ids
        assert batch.input_ids(i).tolist() == t.prompt_ids + t.response_ids
        assert batch.logp_infer(i).tolist() == _as_float32(t.logp_infer)
        assert batch.versions(i).tolist() == t.versions
    dtypes = {k: v.dtype for k, v in batch.arrays.items()}
    assert dtypes["prompt_ids"] == dtypes["response_ids"] == dtypes["versions"] == torch.int32
    assert dtypes["logp_infer"] == torch.float32 and dtypes["response_ids.offsets"] == torch.int64


# -- in one process ---------------------------------------------------------------------------------
def test_pack_then_read_back_keeps_every_value():
    trajs = graded_trajectories()
    batch = TrajectoryBatch.from_trajectories(trajs)
    assert_batch_holds(batch, trajs)
    # one flat array per field, offsets into it: no per-trajectory objects are kept
    assert batch.arrays["response_ids"].tolist() == [x for t in trajs for x in t.response_ids]
    assert batch.arrays["response_ids.offsets"].tolist() == [0, 5, 5, 22, 23, 63]
    # views, not copies
    assert batch.response_ids(2).untyped_storage().data_ptr() == batch.arrays["response_ids"].untyped_storage().data_ptr()


def test_unpack_gives_the_trajectories_back():
    trajs = graded_trajectories()
    info = [{"uid": t.uid, "group_id": t.group_id, "answers": t.answers, "meta": t.meta} for t in trajs]
    for got, want in zip(unpack_trajectories(pack_trajectories(trajs), info), trajs, strict=True):
        expected = want.to_dict()
        expected["logp_infer"] = _as_float32(want.logp_infer)
        assert got.to_dict() == expected


def test_rl_consumers_read_the_arrays():
    """rollout_metrics and attach_ppo_fields on the arrays give what the trajectories say, by hand."""
    from rlrecipe.recipe.training import RLSection
    from rlrecipe.stages.rl import attach_ppo_fields, recompute_old_logprobs, rollout_metrics

    trajs = graded_trajectories()
    trajs = [t for t in trajs if t.response_ids]  # a trained batch has responses
    batch = TrajectoryBatch.from_trajectories(trajs)
    m = rollout_metrics(batch, [torch.tensor([1.0, 3.0])], version=6)
    staleness = [6 - v for t in trajs for v in t.versions]
    assert m["reward_mean"] == sum(t.reward for t in trajs) / 4
    assert m["accuracy"] == 2 / 4 and m["truncated_frac"] == 1 / 4  # correct None counts as wrong
    assert m["tokens_trained"] == 5 + 17 + 1 + 40 and m["response_len_max"] == 40
    assert m["staleness_max"] == max(staleness) and m["staleness_mean"] == sum(staleness) / len(staleness)

    class Trainer:  # logp_old = the inference log-probs: IcePop keeps every token
        def compute_logprobs(self, samples):
            return [(torch.tensor(_as_float32(t.logp_infer)), torch.zeros(len(t.response_ids))) for t in trajs]

    samples, logp_old, _ = recompute_old_logprobs(Trainer(), batch)
    assert [s.input_ids.tolist() for s in samples] == [t.prompt_ids + t.response_ids for t in trajs]
    assert [s.start for s in samples] == [len(t.prompt_ids) for t in trajs]
    out = attach_ppo_fields(samples, batch, logp_old, RLSection(adv_norm="none"))
    assert out["icepop_masked_frac"] == 0.0 and out["mismatch_abs_logp"] == 0.0
    for s, t in zip(samples, trajs, strict=True):
        assert s.columns.adv.tolist() == [t.reward] * len(t.response_ids)
        assert s.columns.logp_infer.tolist() == _as_float32(t.logp_infer)


def test_tensor_input_ids_train_as_lists_do(tiny_model_dir):
    """The engine's log-probs from int32 tensor input_ids are bit-identical to those from lists."""
    from rlrecipe.recipe.systems import TrainerSection
    from rlrecipe.train.base import TrainSample
    from rlrecipe.train.torch_engine import TorchTrainEngine

    eng = TorchTrainEngine(tiny_model_dir, TrainerSection(max_tokens_per_microbatch=40), total_steps=1)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (12, 30, 7, 21)]
    as_lists = eng.compute_logprobs([TrainSample(s, 3) for s in seqs])
    as_tensors = eng.compute_logprobs([TrainSample(torch.tensor(s, dtype=torch.int32), 3) for s in seqs])
    for (lp_a, en_a), (lp_b, en_b) in zip(as_lists, as_tensors, strict=True):
        assert torch.equal(lp_a, lp_b) and torch.equal(en_a, en_b)


# -- two real ranks ----------------------------------------------------------------------------------
def worker(spec: dict) -> None:
    """Under torchrun, 2 ranks over gloo: broadcast a batch (or fail on rank 0) and record what arrived."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rlrecipe.core import dist as dist_ranks
    from rlrecipe.trajectory import arrays as ranks

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(spec["out"])
    if spec["mode"] == "error":
        def collect():
            raise RuntimeError("grader died")
        try:
            ranks.broadcast_batch_from_rank_zero(collect)
            result = "returned"
        except RuntimeError as err:
            result = f"raised: {err}"
        except SystemExit as err:
            result = f"exit {err.code}"
        (out / f"rank{rank}.txt").write_text(result)
        dist.destroy_process_group()
        return

    def collect():
        if rank != 0:
            raise AssertionError("only rank 0 collects")
        return TrajectoryBatch.from_trajectories(graded_trajectories()), {"step": 7}

    batch, small = ranks.broadcast_batch_from_rank_zero(collect)
    types = sorted({type(v).__name__ for v in batch.arrays.values()})
    save_file(batch.arrays, str(out / f"rank{rank}.safetensors"),
              metadata={"uids": json.dumps(batch.uids), "group_ids": json.dumps(batch.group_ids),
                        "small": json.dumps(small), "types": json.dumps(types)})
    # the chunked path nccl takes, with a CPU staging buffer: rank 0's bytes arrive whole
    data = torch.arange(101, dtype=torch.int32) * 7919 if rank == 0 else torch.zeros(101, dtype=torch.int32)
    dist_ranks._broadcast_bytes(data.view(torch.uint8), torch.empty(CHUNK_BYTES, dtype=torch.uint8), rank == 0)
    (out / f"rank{rank}.chunked.json").write_text(json.dumps(data.tolist()))
    dist.destroy_process_group()


def _two_ranks(spec: dict) -> None:
    run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                 __file__, json.dumps(spec)])


@pytest.mark.slow
def test_two_ranks_receive_rank_zeros_arrays(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    _two_ranks({"mode": "batch", "out": str(tmp_path)})
    received = {}
    for rank in (0, 1):
        path = str(tmp_path / f"rank{rank}.safetensors")
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        assert json.loads(meta["types"]) == ["Tensor"] and json.loads(meta["small"]) == {"step": 7}
        received[rank] = TrajectoryBatch(load_file(path), json.loads(meta["uids"]), json.loads(meta["group_ids"]))
    assert received[0].arrays.keys() == received[1].arrays.keys()
    for name, t in received[0].arrays.items():
        assert received[1].arrays[name].dtype == t.dtype and torch.equal(received[1].arrays[name], t), name
    assert_batch_holds(received[1], graded_trajectories())  # and they are the trajectories' values
    sent = (torch.arange(101, dtype=torch.int32) * 7919).tolist()
    assert [json.loads((tmp_path / f"rank{r}.chunked.json").read_text()) for r in (0, 1)] == [sent, sent]


@pytest.mark.slow
def test_an_error_on_rank_zero_raises_there_and_ends_the_other_rank_quietly(tmp_path):
    _two_ranks({"mode": "error", "out": str(tmp_path)})
    assert (tmp_path / "rank0.txt").read_text() == "raised: grader died"
    assert (tmp_path / "rank1.txt").read_text() == "exit 1"


if __name__ == "__main__":
    from rlrecipe.train.launch import end_process

    worker(json.loads(sys.argv[1]))
    end_process(0)  # a rank can abort in the interpreter's teardown after its result is written
