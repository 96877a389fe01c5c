"""Weights into an SGLang fleet: loads from an HF export, a broadcast or tensors, each verified after it lands.

`weight_sync: disk` asks every live server to `/update_weights_from_disk`, node by node: first one
server of each node (the servers' URL hosts), side by side, then all the others, MAX_PARALLEL_LOADS at a
time. The export lies on the shared file system (the run directory), and the servers of a node share
its page cache: the first load of a node reads the files from the shared file system, and its other
servers find them in memory. A push thus costs the shared file system one read of the export per
node, whatever the number of servers on it (80 one-GPU servers on 10 nodes: 10 reads of the 15 GB of
a 7B model, not 80; bench/projection/push.py costs both). `distributed` broadcasts the trainer's
tensors (`sglang/broadcast.py`); `tensor` and `ipc` post them by value or by handle
(`sglang/tensor_push.py`). Either way, servers left out that answer again are
taken back first, so they get this push's weights, and afterwards every live server's weights are
checked against the trainer's (`weights/check.py`), since an update that answers 200 has run a load,
not necessarily loaded the trainer's weights.

Under trainer.lora the base stays and each push is an adapter (`sglang/lora.py`): loaded on every
live server under a new name, named in every /generate from then on, checked by the probe under
that name (nothing else sees an adapter), and the previous adapter unloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import requests

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import MAX_PARALLEL_LOADS, SGLangServer
from rlrecipe.rollout.sglang.down import failed_push, leave_out_down, require_up
from rlrecipe.rollout.sglang.fleet import ServerFleet
from rlrecipe.rollout.sglang.server import model_arg
from rlrecipe.rollout.weights.transport import WeightTransport, weight_transport

if TYPE_CHECKING:
    from rlrecipe.rollout.sglang.broadcast import WeightBroadcast


def same_model(a: str | Path, b: str | Path) -> bool:
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")


def node_waves(urls: list[str], members: list[int]) -> tuple[list[int], list[int]]:
    """`members` (indices into `urls`) in two waves: the first server of each node (URL host), then the
    rest. A node is a host name as the URLs spell it: servers a node reaches under two names count twice,
    which costs one more read, never a wrong load."""
    first: dict[str, int] = {}
    rest: list[int] = []
    for i in members:
        host = urlsplit(urls[i]).hostname or urls[i]
        if host in first:
            rest.append(i)
        else:
            first[host] = i
    return list(first.values()), rest


class WeightPusher:
    """Pushes the trainer's weights into a fleet's live servers and verifies what they then serve."""

    def __init__(self, fleet: ServerFleet, cfg: SGLangServer, served_dtype: str | None, lora: bool = False):
        self.fleet = fleet
        self.transport = weight_transport("sglang", cfg, lora)
        # the dtype the servers hold weights in (rollout.dtype; None: as sent): the fingerprint after
        # each push compares in it (weights/check.py); servers without /get_weights_by_name are skipped
        self.served_dtype = served_dtype
        self.broadcast: WeightBroadcast | None = None  # weight_sync: distributed, made on first use
        self.check = None  # weights.check.WeightCheck, made on first use (it needs torch)
        # the trainer's log-probs of the probe by version (weights/probe.py), and those of the last check
        self.scores: dict[int, object] = {}
        self.last_scores = None
        fleet.on_members_changed = self._members_changed

    @property
    def no_weight_check(self) -> set[int]:
        """Servers whose weights cannot be verified (neither checksums nor rows)."""
        return self.check.unverified if self.check is not None else set()

    @property
    def weight_check_s(self) -> float:
        """Seconds the last verification took: the trainer's tensors read, every server asked."""
        return self.check.seconds if self.check is not None else 0.0

    def _members_changed(self) -> None:
        if self.broadcast is not None:
            self.broadcast.members_changed()

    def ensure_model(self, model_dir: str | Path, version: int) -> None:
        """Attached servers must serve `model_dir`: reload it where /model_info says otherwise."""
        for i in range(len(self.fleet.urls)):
            try:
                current = self.fleet.model_info(i).get("model_path")
            except (requests.RequestException, ValueError) as err:
                raise self.fleet.down_error(i, err, "did not answer /model_info") from None
            if current is None or not same_model(current, model_dir):
                self._update_one(i, model_arg(model_dir), version)

    def _update_one(self, i: int, model_path: str, version: int) -> None:
        self.fleet.control(i, "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)},
                           3600.0)
        self.fleet.weight_version[i] = str(version)  # the update flushed the server's prefix cache too

    def update_from_disk(self, model_dir: str | Path, version: int, verify: bool = True) -> None:
        """Every live server loads the HF export `model_dir`; `verify` False leaves the check to the
        caller (a colocated server verifies once its KV cache is back: the probe generates)."""
        fleet = self.fleet
        fleet.check_alive()
        model_path = model_arg(model_dir)
        back = set(fleet.take_back(version))
        self._forget(back)
        # one server per node reads the shared file system; the node's others load from its page cache
        for wave in node_waves(fleet.urls, list(fleet.live)):
            if not wave:
                continue
            with ThreadPoolExecutor(max_workers=min(len(wave), MAX_PARALLEL_LOADS)) as pool:
                futures = {i: pool.submit(self._update_one, i, model_path, version) for i in wave}
                for i, fut in futures.items():
                    try:
                        fut.result()
                    except UserError as err:
                        if i in back:  # taken back too soon: out again (only retry takes servers back)
                            fleet.leave_out(i, err)
                        else:
                            failed_push(fleet, i, err)
        fleet.pushed(version)
        if verify:
            self.verify_export(model_dir, version)

    def update_from_state(self, state_dict: dict, version: int) -> None:
        """Broadcast the weights into the servers (weight_sync: distributed), or send them in
        /update_weights_from_tensor requests (weight_sync: tensor); nothing touches disk."""
        if self.transport is WeightTransport.TENSOR:
            self.update_from_tensor(state_dict, version)
            return
        if self.transport is not WeightTransport.BROADCAST:
            raise NotImplementedError("SGLangEngine takes weights from disk unless rollout.sglang.weight_sync "
                                      "is distributed or tensor")
        fleet = self.fleet
        fleet.check_alive()
        self._forget(fleet.take_back(version))
        # imported here: the broadcast path needs torch, the HTTP client does not
        from rlrecipe.rollout.sglang.broadcast import BroadcastCut, WeightBroadcast

        if self.broadcast is None:
            self.broadcast = WeightBroadcast(fleet)
        if self.broadcast.needs_group:
            require_up(fleet, "is down: the weight update group cannot be made with it")
        try:
            self.broadcast.push(state_dict, version)
        except BroadcastCut:
            raise
        except UserError:
            # a server down before any joined the push's collective (an attached one is known only
            # so): with retry, left out and the push made again in a group without it
            if not (fleet.cfg.retry_on_other_servers and leave_out_down(fleet, "failed a weight push")):
                raise
            self.broadcast.push(state_dict, version)
        for i in fleet.live:
            fleet.weight_version[i] = str(version)
        fleet.pushed(version)
        self.verify(version, state=state_dict)

    def update_from_tensor(self, state_dict: dict, version: int, verify: bool = True) -> None:
        """Send the weights pickled into /update_weights_from_tensor requests (sglang/tensor_push.py),
        whatever rollout.sglang.weight_sync says, then verify them as any push (`verify` False: the
        caller does, as update_from_disk)."""
        from rlrecipe.rollout.sglang.tensor_push import push_tensors  # needs torch; the HTTP client does not

        fleet = self.fleet
        fleet.check_alive()
        self._forget(fleet.take_back(version))
        push_tensors(fleet, state_dict, version)
        for i in fleet.live:
            fleet.weight_version[i] = str(version)
        fleet.pushed(version)
        if verify:
            self.verify(version, state=state_dict)

    @contextmanager
    def handles_pushed(self, version: int, world_size: int) -> Iterator:
        """A push by handles (weight_sync: ipc; weights/handle_push.py drives it from every rank):
        yields the `send` of each bucket; the servers hold `version` once the block ends. Verified by
        the caller, with the weights it pushed."""
        # imported here: it needs torch, the HTTP client does not
        from rlrecipe.rollout.sglang.tensor_push import handle_session

        fleet = self.fleet
        fleet.check_alive()
        self._forget(fleet.take_back(version))
        with handle_session(fleet, version, world_size) as send:
            yield send
        for i in fleet.live:
            fleet.weight_version[i] = str(version)
        fleet.pushed(version)

    def update_adapter(self, adapter, version: int, verify: bool = True) -> None:
        """Every live server loads `adapter` (weights/adapter.py: by value, or from its directory) as
        the adapter of `version`; /generate names it from then on; verified by the probe (`verify`
        False: by the caller, `verify_adapter`); the adapter replaced at the previous push is unloaded."""
        from rlrecipe.rollout.sglang import lora
        from rlrecipe.rollout.sglang.tensor_push import tp_size  # needs torch; the HTTP client does not

        fleet = self.fleet
        fleet.check_alive()
        self._forget(fleet.take_back(version))
        name, old = lora.adapter_name(fleet.adapter_prefix, version), fleet.adapter
        for i in list(fleet.live):
            try:
                lora.load(fleet, i, name, adapter, 1 if adapter.path is not None else tp_size(fleet, i))
            except UserError as err:
                failed_push(fleet, i, err)
        fleet.adapter = name
        fleet.pushed(version)
        if verify:
            self.verify_adapter(version)
        # the adapter replaced now may still serve requests in flight, and an unload waits for them:
        # it goes at the next push; the one replaced at the last push is named by no request now
        for stale in fleet.retired_adapters:
            for i in list(fleet.live):
                try:
                    lora.unload(fleet, i, stale)
                except UserError as err:
                    failed_push(fleet, i, err)
        fleet.retired_adapters = [old] if old is not None and old != name else []

    def verify_adapter(self, version: int, when: str | None = None) -> None:
        """Each live server's log-probs of the probe under its current adapter are the trainer's for
        `version` (weights/probe.py), not the previous push's."""
        from rlrecipe.rollout.weights.check import WeightCheck

        if self.check is None:
            self.check = WeightCheck(self.fleet)
        scores, prev = self._scores_for(version)
        self.check.run_probe(version, scores, prev, when)
        self._checked(version, scores)

    def _scores_for(self, version: int):
        """The trainer's probe scores of `version`, and the previous push's to tell them apart from."""
        scores, prev = self.scores.get(version), self.last_scores
        if prev is not None and prev.version == version:
            prev = None  # the same version pushed again (a resumed run): nothing earlier to tell apart
        return scores, prev

    def _checked(self, version: int, scores) -> None:
        if scores is not None:
            self.last_scores = scores
            self.scores = {v: s for v, s in self.scores.items() if v > version}

    def verify_export(self, model_dir: str | Path, version: int, when: str | None = None) -> None:
        """Each server serves the weights of the HF directory `model_dir` (the trainer's export, or
        the stage's starting model); a hub id has no local rows to compare."""
        if Path(model_dir).is_dir():
            self.verify(version, model_dir=model_dir, when=when)

    def verify(self, version: int, *, state: dict | None = None, model_dir: str | Path | None = None,
               when: str | None = None) -> None:
        """Each live server holds the trainer's weights, `state` or the HF directory `model_dir`
        (weights/check.py; imported here: it needs torch, the HTTP client does not)."""
        import torch

        from rlrecipe.rollout.weights.check import TrainerWeights, WeightCheck

        if self.check is None:
            self.check = WeightCheck(self.fleet)
        served = getattr(torch, self.served_dtype) if self.served_dtype else None
        scores, prev = self._scores_for(version)
        self.check.run(TrainerWeights(state=state, model_dir=model_dir), version, served, when, scores, prev)
        self._checked(version, scores)

    def expect(self, scores) -> None:
        """The trainer's log-probs of the probe under the weights of `scores.version` (weights/probe.py)."""
        self.scores[scores.version] = scores
        if self.last_scores is None and scores.version == self.fleet.version:
            self.last_scores = scores  # the weights the servers start with: the first push is told apart from them

    def _forget(self, servers) -> None:
        if self.check is not None:
            self.check.forget(list(servers))

    def close(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()
