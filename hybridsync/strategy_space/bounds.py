"""What the strategy space may use on a cluster: ``SpaceBounds``, read by the sampler and the repair."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy_space.batch import HIER, PS, RING

MAX_PARTITIONS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpaceBounds:
    """What the sampler may use."""

    num_servers: int = 0
    """Parameter servers available; 0 leaves the PS route out."""
    hierarchical: bool = True
    """Whether hierarchical all-reduce may be drawn (pointless with one rank per node: it runs as
    the ring all-reduce there, ``ClusterSpec.hierarchical_is_ring``)."""
    max_partitions: int = MAX_PARTITIONS
    """Upper bound on a variable's shards."""
    densify_sparse: bool = False
    """Whether a sparse gradient may be all-reduced in a way that makes it dense (hierarchical,
    partitioned, grouped or compressed). Off by default, as in AutoSync's knowledge
    constraints: a dense all-reduce of an embedding table is many times slower than the
    baselines (benchmarks/RESULTS.md, "Strategy search"). Off, a sparse variable goes to the
    PS or to Horovod's sparse all-gather (ring, own message)."""
    exact: bool = False
    """Only strategies whose numerics are plain Horovod's (up to summation order): no fp16
    compression and only BSP on the parameter servers. Off by default: fp16 and ASP/SSP are
    part of the space, and most of the larger measured gains use fp16."""
    server_memory_bytes: int | None = None
    """Parameter bytes one server may hold (None: no bound). The repair keeps each server's
    explicit placement plus its even share of the balanced bytes under it, moving the largest
    PS variables to ring all-reduce when the servers cannot hold them all."""

    def __post_init__(self) -> None:
        if self.num_servers < 0 or self.max_partitions < 1:
            raise ValueError(f"SpaceBounds: need num_servers >= 0 and max_partitions >= 1, got {self}")
        if self.server_memory_bytes is not None and self.server_memory_bytes < 1:
            raise ValueError(f"SpaceBounds: server_memory_bytes must be >= 1 or None, got {self.server_memory_bytes}")

    @property
    def routes(self) -> tuple[int, ...]:
        """The ``StrategyBatch.route`` codes within these bounds: ring, hierarchical unless it is
        left out, the parameter servers if there are any."""
        return tuple(code for code, allowed in ((RING, True), (HIER, self.hierarchical), (PS, self.num_servers > 0))
                     if allowed)


def bounds_for(cluster: ClusterSpec, **overrides: Any) -> SpaceBounds:
    """The bounds of ``cluster``: its servers, and hierarchical all-reduce only where it is not the ring
    (``ClusterSpec.hierarchical_is_ring``); ``overrides`` set other fields (``max_partitions=...``)."""
    return SpaceBounds(num_servers=cluster.num_servers, hierarchical=not cluster.hierarchical_is_ring, **overrides)
