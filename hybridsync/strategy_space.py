"""The strategy space: random valid strategies for trials and the search (toolchain; torch-free).

A strategy is drawn in two levels, so that the samples cover pure strategies, mixes that
lean one way, and even mixes alike (a flat per-variable draw would make every sample an
even mix of everything):

1. strategy-level knobs: route weights (a Dirichlet draw over ring, hierarchical and PS),
   the PS protocol, how often fp16 is used, the number of merge groups and the partition size;
2. per variable: a route drawn from those weights (or, in ``BY_CLASS`` of the strategies,
   one route per class of variable: sparse, large dense, small dense), then its partitions,
   compression and (for the PS) an explicit server placement or none (balanced by bytes).

Merge groups are formed afterwards in backward order (last variable first, as gradients
become ready) among the variables that can share a message (same route, variant,
compression). Every result is a validated ``Strategy``. Torch-free; randomness only from
the ``numpy.random.Generator`` passed in.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo

ROUTE_CHOICES: tuple[tuple[str, str], ...] = (("allreduce", "ring"), ("allreduce", "hierarchical"), ("ps", "bsp"))
"""What a variable's route is drawn from; the PS entry's protocol is then the strategy's."""
PARTITION_BYTES_CHOICES: tuple[int | None, ...] = (None, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Split variables larger than this into shards of about this size (None: never split)."""
GROUP_COUNT_CHOICES: tuple[int, ...] = (0, 1, 2, 4, 8)
"""Merge groups per message class (0: every variable its own message)."""
MAX_PARTITIONS = 16
BY_CLASS = 0.4
"""Share of strategies that route by variable class (sparse, large dense, small dense) rather
than variable by variable: the hand-made mixes that work (Parallax; embeddings on the PS and
dense layers hierarchical and fused) are of that kind, and a per-variable draw almost never
produces one."""
LARGE_DENSE_BYTES = 1024 * 1024
CLASSES = ("sparse", "large", "small")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpaceBounds:
    """What the sampler may use."""

    num_servers: int = 0
    """Parameter servers available; 0 leaves the PS route out."""
    hierarchical: bool = True
    """Whether hierarchical all-reduce may be drawn (pointless with one rank per node)."""
    max_partitions: int = MAX_PARTITIONS
    """Upper bound on a variable's shards."""
    densify_sparse: bool = False
    """Whether a sparse gradient may be all-reduced in a way that makes it dense (hierarchical,
    partitioned, grouped or compressed). Off by default, as in AutoSync's knowledge
    constraints: a dense all-reduce of an embedding table was 7-17x slower than the best
    baseline for the zoo's ``ncf`` on 2 x 2 hosts at 1 Gbit/s. Off, a sparse variable goes to the PS
    or to Horovod's sparse all-gather (ring, own message)."""
    exact: bool = False
    """Only strategies whose numerics are plain Horovod's (up to summation order): no fp16
    compression and only BSP on the parameter servers. Off by default: fp16 and ASP/SSP are
    part of the space, and most of the larger measured gains use fp16."""
    server_memory_bytes: int | None = None
    """Parameter bytes one server may hold (None: no bound). The search's repair keeps each
    server's explicit placement plus its even share of the balanced bytes under it, moving
    the largest PS variables to ring all-reduce when the servers cannot hold them all."""

    def __post_init__(self) -> None:
        if self.num_servers < 0 or self.max_partitions < 1:
            raise ValueError(f"SpaceBounds: need num_servers >= 0 and max_partitions >= 1, got {self}")
        if self.server_memory_bytes is not None and self.server_memory_bytes < 1:
            raise ValueError(f"SpaceBounds: server_memory_bytes must be >= 1 or None, got {self.server_memory_bytes}")

    @property
    def routes(self) -> list[tuple[str, str]]:
        """The (route, variant) choices within these bounds (``ROUTE_CHOICES`` less what is missing)."""
        return [c for c in ROUTE_CHOICES
                if (c[0] != "ps" or self.num_servers > 0) and (c[1] != "hierarchical" or self.hierarchical)]

    def needs_allgather(self, info: VariableInfo, route: str) -> bool:
        """Whether ``info``'s gradient on ``route`` must be Horovod's sparse all-gather (ring, a message
        of its own, uncompressed), anything else making it dense."""
        return info.sparse and route == "allreduce" and not self.densify_sparse


def bounds_for(cluster: ClusterSpec, **overrides: Any) -> SpaceBounds:
    """The bounds of ``cluster``: its servers, and hierarchical all-reduce only with more than one
    rank per node; ``overrides`` set other fields (``max_partitions=...``)."""
    return SpaceBounds(num_servers=cluster.num_servers, hierarchical=cluster.workers_per_node > 1, **overrides)


SPARSE_ALLGATHER = VarConfig(route="allreduce")
"""How a sparse gradient is all-reduced without being made dense (``SpaceBounds.needs_allgather``)."""


def random_strategy(variables: Mapping[str, VariableInfo], bounds: SpaceBounds,
                    rng: np.random.Generator) -> Strategy:
    """One random valid strategy for ``variables`` within ``bounds``."""
    routes = bounds.routes
    weights = rng.dirichlet([0.6] * len(routes))
    protocol, staleness = _protocol(rng)
    fp16_share = float(rng.choice([0.0, 0.0, 0.5, 1.0]))
    partition_bytes = PARTITION_BYTES_CHOICES[rng.integers(len(PARTITION_BYTES_CHOICES))]
    num_groups = int(rng.choice(GROUP_COUNT_CHOICES))
    explicit_servers = bool(rng.random() < 0.3)
    by_class = {c: routes[rng.choice(len(routes), p=weights)] for c in CLASSES} if rng.random() < BY_CLASS else None
    configs = {}
    for name, info in variables.items():
        route, algorithm = (by_class[variable_class(info)] if by_class is not None
                            else routes[rng.choice(len(routes), p=weights)])
        partitions = _partitions(info, partition_bytes, bounds.max_partitions)
        compression = "fp16" if info.dtype == "float32" and rng.random() < fp16_share else None
        if bounds.needs_allgather(info, route):
            configs[name] = SPARSE_ALLGATHER
        elif route == "ps":
            servers = (tuple(int(s) for s in rng.integers(bounds.num_servers, size=partitions))
                       if explicit_servers else None)
            configs[name] = VarConfig(route="ps", protocol=protocol, staleness=staleness, partitions=partitions,
                                      compression=compression, servers=servers)
        else:
            configs[name] = VarConfig(route="allreduce", algorithm=algorithm, partitions=partitions,
                                      compression=compression)
    keep_alone = {n for n, info in variables.items() if bounds.needs_allgather(info, configs[n].route)}
    strategy = Strategy(variables=_with_groups(configs, num_groups, keep_alone))
    strategy.validate_for(variables)
    return strategy


def variable_class(info: VariableInfo) -> str:
    """``sparse``, ``large`` (dense, at least ``LARGE_DENSE_BYTES``) or ``small`` (dense): the classes
    that hand-made mixes treat alike (``BY_CLASS``, ``search.seeds``, the class-wide mutations)."""
    if info.sparse:
        return "sparse"
    return "large" if info.nbytes >= LARGE_DENSE_BYTES else "small"


def _protocol(rng: np.random.Generator) -> tuple[str, int | None]:
    """Mostly BSP; sometimes ASP, or SSP with a staleness of 1-3 steps."""
    draw = rng.random()
    if draw < 0.7:
        return "bsp", None
    if draw < 0.85:
        return "asp", None
    return "ssp", int(rng.integers(1, 4))


def _partitions(info: VariableInfo, partition_bytes: int | None, max_partitions: int) -> int:
    rows = info.shape[0] if info.shape else 1
    if partition_bytes is None or info.nbytes <= partition_bytes:
        return 1
    return max(1, min(rows, max_partitions, math.ceil(info.nbytes / partition_bytes)))


def _with_groups(configs: dict[str, VarConfig], num_groups: int, keep_alone: set[str]) -> dict[str, VarConfig]:
    """Split each message class (backward order) into ``num_groups`` contiguous runs, one group
    each; variables in ``keep_alone`` stay in messages of their own."""
    if num_groups == 0:
        return configs
    classes: dict[tuple, list[str]] = {}
    for name in reversed(list(configs)):
        if name not in keep_alone:
            classes.setdefault(configs[name].message_key, []).append(name)
    grouped, next_group = dict(configs), 0
    for names in classes.values():
        run = math.ceil(len(names) / num_groups)
        for start in range(0, len(names), run):
            for name in names[start:start + run]:
                grouped[name] = dataclasses.replace(configs[name], group=next_group)
            next_group += 1
    return grouped
