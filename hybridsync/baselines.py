"""Hand-made strategies, as plain functions of a model's variables.

These are what a user would pick by hand (and what AutoDist ships as builders); the
autotuner has to beat every one of them. Each returns a validated ``Strategy``.
"""
from __future__ import annotations

import math
from typing import Mapping

from hybridsync.placement import DEFAULT_PARTITION_BYTES, LeastLoaded, place_keys
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo


def _build(variables: Mapping[str, VariableInfo], configs: Mapping[str, VarConfig]) -> Strategy:
    strategy = Strategy(variables=dict(configs))
    strategy.validate_for(variables)
    return strategy


def all_allreduce(variables: Mapping[str, VariableInfo]) -> Strategy:
    """Horovod's default: every variable ring all-reduced, each its own message."""
    return _build(variables, {name: VarConfig(route="allreduce") for name in variables})


def all_hierarchical(variables: Mapping[str, VariableInfo]) -> Strategy:
    """Every variable hierarchically all-reduced (within each node first), each its own message."""
    return _build(variables, {name: VarConfig(route="allreduce", algorithm="hierarchical") for name in variables})


HOROVOD_FUSION_BYTES = 64 * 1024 * 1024
"""Horovod's default fusion buffer (``HOROVOD_FUSION_THRESHOLD``): tensors ready together share one."""


def horovod_hierarchical(variables: Mapping[str, VariableInfo], fusion_bytes: int = HOROVOD_FUSION_BYTES) -> Strategy:
    """Horovod's global ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``, written per variable.

    Horovod fuses the dense gradients ready in one cycle into buffers of up to
    ``fusion_bytes`` and all-reduces each buffer hierarchically; here consecutive dense
    variables (backward order: last parameter first) fill merge groups of up to
    ``fusion_bytes``. Sparse gradients keep Horovod's all-gather (ring route, no group).
    """
    if fusion_bytes < 1:
        raise ValueError(f"fusion_bytes must be >= 1, got {fusion_bytes}")
    configs, group, filled = {}, 0, 0
    for name in reversed(list(variables)):
        info = variables[name]
        if info.sparse:
            configs[name] = VarConfig(route="allreduce")
            continue
        if filled and filled + info.nbytes > fusion_bytes:
            group, filled = group + 1, 0
        filled += info.nbytes
        configs[name] = VarConfig(route="allreduce", algorithm="hierarchical", group=group)
    return _build(variables, {name: configs[name] for name in variables})


def all_ps(variables: Mapping[str, VariableInfo], num_servers: int) -> Strategy:
    """Every variable on the parameter servers, placed round-robin (BytePS/TF PS default)."""
    _check_servers(num_servers)
    return _build(variables, {name: VarConfig(route="ps", servers=(i % num_servers,))
                              for i, name in enumerate(variables)})


def load_balanced_ps(variables: Mapping[str, VariableInfo], num_servers: int) -> Strategy:
    """Every variable on the PS, largest first onto the least-loaded server (greedy by bytes)."""
    _check_servers(num_servers)
    placement = place_keys({name: info.nbytes for name, info in variables.items()}, num_servers)
    return _build(variables, {name: VarConfig(route="ps", servers=(placement[name],)) for name in variables})


def partitioned_ps(variables: Mapping[str, VariableInfo], num_servers: int,
                   partition_bytes: int = DEFAULT_PARTITION_BYTES) -> Strategy:
    """Every variable on the PS, split into shards of about ``partition_bytes``, shards load-balanced."""
    _check_servers(num_servers)
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
    balancer = LeastLoaded(num_servers)
    configs = {}
    for info in sorted(variables.values(), key=lambda v: (-v.nbytes, v.name)):
        rows = info.shape[0] if info.shape else 1
        partitions = max(1, min(rows, math.ceil(info.nbytes / partition_bytes)))
        servers = tuple(balancer.take(info.nbytes // partitions) for _ in range(partitions))
        configs[info.name] = VarConfig(route="ps", partitions=partitions, servers=servers)
    return _build(variables, {name: configs[name] for name in variables})


def parallax(variables: Mapping[str, VariableInfo], num_servers: int, num_groups: int = 1) -> Strategy:
    """Parallax's sparsity-aware hybrid: sparse variables -> PS, dense -> all-reduce in ``num_groups`` fused groups."""
    _check_servers(num_servers)
    dense = [name for name, info in variables.items() if not info.sparse]
    chunk = max(1, math.ceil(len(dense) / max(1, num_groups)))
    configs = {name: VarConfig(route="allreduce", group=i // chunk) for i, name in enumerate(dense)}
    sparse = [name for name, info in variables.items() if info.sparse]
    configs.update({name: VarConfig(route="ps", servers=(i % num_servers,)) for i, name in enumerate(sparse)})
    return _build(variables, {name: configs[name] for name in variables})


def _check_servers(num_servers: int) -> None:
    if not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an integer >= 1, got {num_servers!r}")


BUILDERS = {"allreduce": all_allreduce, "hierarchical": all_hierarchical,
            "horovod-hierarchical": horovod_hierarchical, "ps": all_ps, "ps-lb": load_balanced_ps,
            "ps-partitioned": partitioned_ps, "parallax": parallax}
"""Builder name -> function, for the command line."""
NEEDS_SERVERS = frozenset({"ps", "ps-lb", "ps-partitioned", "parallax"})
"""Builders that take ``num_servers`` (their strategies route variables to parameter servers)."""


def build_baseline(name: str, variables: Mapping[str, VariableInfo], num_servers: int) -> Strategy:
    """The baseline ``name`` for ``variables``; ``num_servers`` is used only by the PS builders."""
    if name not in BUILDERS:
        raise ValueError(f"unknown baseline {name!r} (known: {', '.join(BUILDERS)})")
    return BUILDERS[name](variables, num_servers=num_servers) if name in NEEDS_SERVERS else BUILDERS[name](variables)
