"""Which ranks share a node, and the Horovod process sets that hierarchical all-reduce needs.

Horovod's own hierarchical all-reduce is compiled out without NCCL (and is one global
switch), so hybridsync builds it from process sets: one set per node (the ranks that
share it) and one per local rank (the ranks across nodes that share a local rank).
Static process sets must be declared at ``hvd.init``; dynamic ones would do, but they
slowed every all-reduce by ~40% here (50 x 256 KB, 2 ranks, Gloo), so ``hs.init``
derives the node layout from the launcher's environment before initializing Horovod.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybridsync.frameworks import horovod_torch

_state: dict[str, Any] = {"layout": None, "sets": None, "problem": "hybridsync.init() was not called "
                          "(hvd.init() declares no process sets for hierarchical all-reduce)"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """Ranks placed node by node: node k holds ranks ``k*local_size .. (k+1)*local_size - 1``."""

    size: int
    local_size: int

    @property
    def num_nodes(self) -> int:
        return self.size // self.local_size

    def node_ranks(self) -> list[list[int]]:
        return [list(range(k * self.local_size, (k + 1) * self.local_size)) for k in range(self.num_nodes)]

    def local_rank_peers(self) -> list[list[int]]:
        return [list(range(i, self.size, self.local_size)) for i in range(self.local_size)]


def layout_from_environment(env: dict[str, str] | None = None) -> NodeLayout | None:
    """The layout horovodrun (Gloo) or Open MPI announces, if the job is homogeneous."""
    env = os.environ if env is None else env
    for size_key, local_key in (("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"),
                                ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        if size_key in env and local_key in env:
            size, local_size = int(env[size_key]), int(env[local_key])
            if local_size >= 1 and size % local_size == 0:
                return NodeLayout(size=size, local_size=local_size)
    return None


@dataclasses.dataclass(frozen=True)
class HierarchicalSets:
    """This rank's two process sets (``None`` where the level has one member)."""

    intra_node: Any
    cross_node: Any
    local_size: int
    num_nodes: int


def init(*args: Any, **kwargs: Any) -> None:
    """``hvd.init`` plus the process sets for hierarchical all-reduce when the job spans nodes."""
    hvd = horovod_torch("hybridsync.init")
    layout = layout_from_environment()
    if "process_sets" in kwargs or layout is None or not 1 < layout.local_size < layout.size:
        hvd.init(*args, **kwargs)
        _state.update(layout=layout, sets=None, problem=None if layout else
                      "the launcher did not announce how many ranks share a node")
        if "process_sets" in kwargs:
            _state["problem"] = "hybridsync.init() was given its own process_sets"
        return
    intra = [hvd.ProcessSet(ranks) for ranks in layout.node_ranks()]
    cross = [hvd.ProcessSet(ranks) for ranks in layout.local_rank_peers()]
    hvd.init(*args, process_sets=intra + cross, **kwargs)
    rank = hvd.rank()
    _state.update(layout=layout, problem=None,
                  sets=HierarchicalSets(intra[rank // layout.local_size], cross[rank % layout.local_size],
                                        layout.local_size, layout.num_nodes))
    if (hvd.local_rank(), hvd.cross_rank()) != (rank % layout.local_size, rank // layout.local_size):
        _state.update(sets=None, problem=f"rank {rank} is local rank {hvd.local_rank()} of node "
                      f"{hvd.cross_rank()}: ranks are not laid out node by node")


def hierarchical_sets() -> HierarchicalSets:
    """This rank's process sets for hierarchical all-reduce; ``RuntimeError`` saying why if there are none."""
    import horovod.torch as hvd
    if _state["sets"] is not None:
        return _state["sets"]
    if _state["problem"] is None and _state["layout"] is not None:
        layout = _state["layout"]
        # One node (or one rank per node): one level of the hierarchy is the whole job.
        return HierarchicalSets(hvd.global_process_set if layout.num_nodes == 1 else None,
                                hvd.global_process_set if layout.local_size == 1 else None,
                                layout.local_size, layout.num_nodes)
    raise RuntimeError(f"hierarchical all-reduce is not available: {_state['problem']}")
