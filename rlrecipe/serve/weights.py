"""The weights `rlrecipe serve` serves: the trainer's update group and SGLang's weight-update session,
and reads of the weights (/get_weights_by_name, /weights_checker checksums, prompt log-probs).

Updates themselves run on the scheduler's thread, which waits until no request runs
(`Scheduler.run_update`); reads hold the scheduler's weights lock, so they never see half an update.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from rlrecipe.rollout.sglang.versions import Dialect
from rlrecipe.rollout.weights.checksum import model_checksums
from rlrecipe.rollout.weights.sync import DEFAULT_GROUP, init_custom_group
from rlrecipe.serve.tensors import BadTensors, read_named_tensors

# /init_weights_update_group waits this long for the trainer's rendezvous, not the 10 minutes a
# weight broadcast may take: an unreachable address must not hold the request that long.
JOIN_TIMEOUT_S = 120.0
# the architectures SGLang 0.5.23 implements /get_weights_by_name for (its models' get_weights_by_name)
WEIGHTS_BY_NAME_ARCHS = {"LlamaForCausalLM", "GraniteForCausalLM", "OPTForCausalLM", "Exaone4ForCausalLM"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Host(Protocol):
    """What of the scheduler the weights need: its engine, lock and rules, and its update queue."""

    engine: Any
    adapters: Any
    weights_lock: threading.Lock
    cond: threading.Condition
    rules: Dialect
    join_timeout_s: float

    def run_update(self, job: dict, timeout: float) -> dict: ...

    def abort(self, rid: str, abort_all: bool = False) -> int: ...


class ServedWeights:
    """The update group and session of one server, and what it answers about its weights."""

    def __init__(self, sched: Host):
        self.sched = sched
        self.groups: dict[str, object] = {}  # weight update groups joined, by name
        self.session_open = False  # SGLang >= 0.5.21: distributed updates run inside a weight-update session

    def prompt_logprobs(self, ids: list[int], lora: str | None = None) -> list[float]:
        """Teacher-forced log-probs of `ids` after the first, under the weights served now (with
        adapter `lora` added)."""
        with self.sched.weights_lock, self.sched.adapters.applied(lora):
            return self.sched.engine.prompt_logprobs(ids)

    def begin_session(self) -> dict:
        with self.sched.cond:
            if self.session_open:
                return {"success": False, "message": "a weight-update session is already open; "
                                                     "call end_weight_update() first"}
            self.session_open = True
        return {"success": True, "message": "Success"}

    def end_session(self) -> dict:
        with self.sched.cond:
            if not self.session_open:
                return {"success": False, "message": "no weight-update session is open; "
                                                     "call begin_weight_update() first"}
            self.session_open = False
        return {"success": True, "message": "Success"}

    def update_weights_from_distributed(self, body: dict, timeout: float = 3600.0) -> dict:
        if self.sched.rules.weight_update_session and not self.session_open:
            return {"success": False, "message": "update_weights_from_distributed must run between "
                                                 "begin_weight_update() and end_weight_update()"}
        # refused as SGLang's control endpoints refuse: HTTP 400 with {"success": false, "message"}
        group = self.groups.get(body.get("group_name", DEFAULT_GROUP))
        if group is None:
            return {"success": False, "message": f"no weight update group {body.get('group_name', DEFAULT_GROUP)!r}: "
                                                 "call /init_weights_update_group first"}
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            return {"success": False, "message": "names, dtypes and shapes must be lists of one length"}
        own = self.sched.engine.model.state_dict()
        for name, shape in zip(names, shapes, strict=True):
            if name not in own or list(own[name].shape) != list(shape):
                return {"success": False, "message": f"tensor {name} {shape} does not fit the served model"}
        return self.sched.run_update({"group": group, "names": names, "dtypes": dtypes, "shapes": shapes,
                                 "weight_version": body.get("weight_version")}, timeout)

    def update_weights_from_tensor(self, body: dict, timeout: float = 3600.0) -> dict:
        """SGLang's /update_weights_from_tensor on one rank (serve/tensors.py reads the body); from 0.5.21
        inside a weight-update session, as update_weights_from_distributed."""
        if self.sched.rules.weight_update_session and not self.session_open:
            return {"success": False, "message": "update_weights_from_tensor must run between "
                                                 "begin_weight_update() and end_weight_update()"}
        try:
            named, files = read_named_tensors(body)
        except BadTensors as err:
            return {"success": False, "message": f"Failed to update weights: {err}"}
        log(f"update_weights_from_tensor: {len(named)} tensors " + (f"by handle from {', '.join(sorted(set(files)))}"
                                                                    if files else "by value"))
        own = self.sched.engine.model.state_dict()
        for name, t in named:
            if name not in own or own[name].shape != t.shape:
                return {"success": False, "message": f"tensor {name} {list(t.shape)} does not fit the served model"}
        if body.get("abort_all_requests"):
            self.sched.abort("", abort_all=True)
        return self.sched.run_update({"tensors": named, "weight_version": body.get("weight_version")}, timeout)

    def weights_by_name(self, name: str, truncate_size: int) -> list | None:
        """The parameter's first `truncate_size` rows as float32 lists (SGLang's /get_weights_by_name);
        None for a name the model does not have, or a model whose architecture SGLang does not
        implement it for (Qwen2 among them)."""
        archs = set(getattr(self.sched.engine.model.config, "architectures", None) or [])
        if not archs & WEIGHTS_BY_NAME_ARCHS:
            log(f"get_weights_by_name: not implemented for {sorted(archs)} (as in SGLang)")
            return None
        with self.sched.weights_lock:
            tensor = self.sched.engine.model.state_dict().get(name)
            if tensor is None:
                log(f"get_weights_by_name: no parameter {name!r}")
                return None
            return tensor.detach()[:max(0, truncate_size)].float().tolist()

    def checksums(self) -> dict:
        """SGLang's /weights_checker {"action": "checksum"} of a one-rank server on the CPU."""
        with self.sched.weights_lock:
            named = {**dict(self.sched.engine.model.named_parameters()), **dict(self.sched.engine.model.named_buffers())}
            sums = model_checksums(named)
        h = hashlib.sha256()
        for name in sorted(sums):
            h.update(name.encode())
            h.update(sums[name].encode())
        info = {"checksums": sums, "per_gpu_checksum": h.hexdigest(),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
        return {"success": True, "message": "Success.", "ranks": [info],
                "per_engine_checksum": hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()}

    def init_group(self, body: dict) -> dict:
        """Join the trainer's weight update group (blocks until every member has joined)."""
        try:
            name = str(body.get("group_name", DEFAULT_GROUP))
            if name in self.groups and not self.sched.rules.destroy_group:
                raise ValueError(f"group name {name} has already been created")  # as SGLang before 0.5.3
            if name in self.groups:  # a trainer that starts over replaces its group
                dist.destroy_process_group(self.groups.pop(name))
            self.groups[name] = init_custom_group(str(body.get("backend", "nccl")), str(body["master_address"]),
                                                  int(body["master_port"]), int(body["rank_offset"]),
                                                  int(body["world_size"]), name,
                                                  join_timeout=datetime.timedelta(seconds=self.sched.join_timeout_s))
            log(f"joined weight update group {name} as rank {body['rank_offset']} of {body['world_size']}")
            return {"success": True, "message": "Succeeded to initialize custom process group."}
        except Exception as err:  # noqa: BLE001 - reported to the client
            return {"success": False, "message": f"Failed to initialize custom process group: {err}."}

    def destroy_group(self, body: dict) -> dict:
        group = self.groups.pop(str(body.get("group_name", DEFAULT_GROUP)), None)
        if group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}
