"""Hand-made strategies, as plain functions of a model's variables.

These are what a user would pick by hand (and what AutoDist ships as builders); the
autotuner has to beat every one of them. Each returns a validated ``Strategy``. Three have
an fp16 twin (``<name>-fp16``): a strategy that wins with fp16 compression is compared with
rivals that have it too (``fp16_twin``, ``levers``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from hybridsync.placement import DEFAULT_PARTITION_BYTES, LeastLoaded, place_keys
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import FLOATING_DTYPES, VariableInfo


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


def with_fp16(strategy: Strategy, variables: Mapping[str, VariableInfo]) -> Strategy:
    """``strategy`` with fp16 compression on every dense floating-point gradient: the twin a Horovod
    user gets by passing ``compression=hvd.Compression.fp16``. Sparse gradients keep their config
    (Horovod's fp16 cannot take them, see ``fp16_twin``)."""
    configs = {name: strategy.config_for(name) for name in variables}
    return _build(variables, {name: dataclasses.replace(config, compression="fp16")
                              if not variables[name].sparse and variables[name].dtype in FLOATING_DTYPES else config
                              for name, config in configs.items()})


FP16_SUFFIX = "-fp16"
FP16_TWINS = ("allreduce", "hierarchical", "horovod-hierarchical", "parallax")
"""Baselines with an fp16 twin (``<name>-fp16``): the fair rivals of a strategy that uses fp16."""
NOT_RUNNABLE_SPARSE_FP16 = ("Horovod 0.28.1's compression=hvd.Compression.fp16 crashes on sparse gradients "
                            "(decompress gets no dtype)")


def fp16_twin(name: str, variables: Mapping[str, VariableInfo], num_servers: int) -> Strategy:
    """Baseline ``name`` with fp16 on its dense gradients; ``ValueError`` where the twin cannot run.

    The ``allreduce`` twin is Horovod with ``Compression.fp16`` (every gradient fp16), which
    Horovod cannot run on a model with sparse gradients: no Horovod user has that rival then.
    """
    if name not in FP16_TWINS:
        raise ValueError(f"baseline {name!r} has no fp16 twin (twins: {', '.join(FP16_TWINS)})")
    if name == "allreduce" and any(info.sparse for info in variables.values()):
        raise ValueError(f"not runnable: {NOT_RUNNABLE_SPARSE_FP16}")
    return with_fp16(build_baseline(name, variables, num_servers), variables)


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
    """The baseline ``name`` (a builder, or a twin ``<builder>-fp16``) for ``variables``;
    ``num_servers`` is used only by the PS builders."""
    if name.endswith(FP16_SUFFIX) and name.removesuffix(FP16_SUFFIX) in FP16_TWINS:
        return fp16_twin(name.removesuffix(FP16_SUFFIX), variables, num_servers)
    if name not in BUILDERS:
        raise ValueError(f"unknown baseline {name!r} (known: {', '.join(BUILDERS)}, and the fp16 twins "
                         f"{', '.join(n + FP16_SUFFIX for n in FP16_TWINS)})")
    return BUILDERS[name](variables, num_servers=num_servers) if name in NEEDS_SERVERS else BUILDERS[name](variables)


def levers(strategy: Strategy | None, variables: Mapping[str, VariableInfo]) -> frozenset[str]:
    """What a strategy uses beyond plain Horovod's numerics on ``variables``: ``fp16``
    (compression on some variable) and ``async`` (ASP/SSP or a switching policy on the PS).
    A rival is fair to a strategy when it uses no lever the strategy does not use."""
    if strategy is None:
        return frozenset()
    configs = [strategy.config_for(name) for name in variables]
    out = set()
    if any(c.compression == "fp16" for c in configs):
        out.add("fp16")
    if any(c.route == "ps" and c.protocol != "bsp" for c in configs) or (
            strategy.sync is not None and strategy.sync.policy != "static"):
        out.add("async")
    return frozenset(out)
