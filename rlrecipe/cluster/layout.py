"""Which node of a cluster job does what, from the recipe alone.

- **Training nodes** (0 .. T-1, T = `trainer.nodes`) each run `trainer.nproc` ranks.
- **Split layouts** put the SGLang servers on nodes of their own (T .. T+R-1, R =
  `rollout.sglang.nodes`), each running `rlrecipe rollout-servers`. The exception is one training
  node whose GPUs also hold every server: the run then launches them itself, beside training.
- **Colocated layouts** (`rollout.colocate`) over several nodes run both roles on every node.
  Each node's servers share its GPUs with its ranks (the recipe checks that they match).
- **In-process rollouts** and servers attached by `rollout.urls` need training nodes only.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import Recipe

TRAIN, ROLLOUT, BOTH = "train", "rollout", "both"


@dataclass(frozen=True)
class JobLayout:
    train_nodes: int
    rollout_nodes: int  # nodes that only serve (split layouts)
    colocated_nodes: bool  # every node trains and serves its own servers
    gpus_per_node: int
    servers_per_node: int  # on a node that serves (0: the run launches its servers, or none)

    @property
    def nodes(self) -> int:
        return self.train_nodes + self.rollout_nodes

    def role(self, node: int) -> str:
        if not 0 <= node < self.nodes:
            raise UserError(f"node {node}: this job has {self.nodes} nodes (0..{self.nodes - 1})")
        if self.colocated_nodes:
            return BOTH
        return TRAIN if node < self.train_nodes else ROLLOUT

    @property
    def serves(self) -> bool:
        return self.rollout_nodes > 0 or self.colocated_nodes


def server_gpus(recipe: Recipe) -> int:
    sg = recipe.rollout.sglang
    return sg.num_servers * sg.tp_size * sg.dp_size


def job_layout(recipe: Recipe, gpus_per_node: int, serving: bool = True) -> JobLayout:
    """The recipe's nodes and their roles on nodes of `gpus_per_node` GPUs (`serving` False: a stage
    without rollouts, SFT); refused in one line where the recipe cannot run so."""
    tr, ro = recipe.trainer, recipe.rollout
    if tr.nproc > gpus_per_node:
        raise UserError(f"trainer.nproc {tr.nproc} ranks a node, but --gpus-per-node is {gpus_per_node}")
    launched = serving and ro.engine == "sglang" and not ro.urls
    if not launched:
        return JobLayout(tr.nodes, 0, False, gpus_per_node, 0)
    sg = ro.sglang
    per_node = sg.num_servers // sg.nodes
    node_gpus = per_node * sg.tp_size * sg.dp_size
    if ro.colocate:
        if tr.nodes == 1 and sg.nodes == 1:
            return JobLayout(1, 0, False, gpus_per_node, 0)  # the run launches its servers on its GPUs
        return JobLayout(tr.nodes, 0, True, gpus_per_node, per_node)
    if tr.nodes == 1 and sg.nodes == 1 and tr.nproc + node_gpus <= gpus_per_node:
        return JobLayout(1, 0, False, gpus_per_node, 0)  # servers beside training, launched by the run
    if node_gpus > gpus_per_node:
        raise UserError(f"rollout.sglang: {per_node} servers a node x tp {sg.tp_size} x dp {sg.dp_size} = {node_gpus} "
                        f"GPUs, but --gpus-per-node is {gpus_per_node}; raise rollout.sglang.nodes")
    return JobLayout(tr.nodes, sg.nodes, False, gpus_per_node, per_node)
