"""Which ranks share a node: the layout hierarchical all-reduce builds its groups on.

Nothing is declared for hierarchical all-reduce at ``hs.init`` (which is ``hvd.init``):
declared Horovod process sets slowed every collective of a job, hierarchical or not
(``groups`` says how much). The layout is read from Horovod once it runs, so a job
started with plain ``hvd.init()`` can route variables hierarchically too.
"""
from __future__ import annotations

import dataclasses
import os


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


def node_layout() -> tuple[NodeLayout | None, str | None]:
    """This job's layout from the running Horovod, or ``None`` and why there is none."""
    import horovod.torch as hvd
    if not hvd.is_initialized():
        return None, "Horovod is not initialized (call hs.init() first)"
    if not hvd.mpi_ops._basics.is_homogeneous():  # not re-exported by horovod.torch
        return None, f"nodes hold different numbers of ranks (rank {hvd.rank()}'s node has {hvd.local_size()})"
    return NodeLayout(size=hvd.size(), local_size=hvd.local_size()), None
