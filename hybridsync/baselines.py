"""Hand-made strategies, as plain functions of a model's variables.

These are what a user would pick by hand (and what AutoDist ships as builders); the
autotuner has to beat every one of them. Each returns a validated ``Strategy``. Four have
twins (``TWINS``) with the levers a hybridsync strategy may use and a Horovod user can pull
too: ``<name>-fp16`` (fp16 compression, ``with_fp16``), ``<name>-rows`` (dense embeddings sent
as their nonzero rows, ``with_rows``: what ``nn.Embedding(sparse=True)`` gives a Horovod or
Parallax user) and ``<name>-rows-fp16``. A strategy that wins with a lever is compared with
rivals that have it too (``twin``, ``levers``).
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
    """Every variable on the PS in shards of at most ``partition_bytes`` (BytePS's 4.1 MB), load-balanced."""
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
    """Parallax's hybrid: sparse variables on the PS, dense ones fused on the ring (in ``num_groups`` messages)."""
    _check_servers(num_servers)
    dense = [name for name, info in variables.items() if not info.sparse]
    chunk = max(1, math.ceil(len(dense) / max(1, num_groups)))
    configs = {name: VarConfig(route="allreduce", group=i // chunk) for i, name in enumerate(dense)}
    sparse = [name for name, info in variables.items() if info.sparse]
    configs.update({name: VarConfig(route="ps", servers=(i % num_servers,)) for i, name in enumerate(sparse)})
    return _build(variables, {name: configs[name] for name in variables})


def with_fp16(strategy: Strategy, variables: Mapping[str, VariableInfo]) -> Strategy:
    """``strategy`` with fp16 compression on every dense floating-point gradient: the twin a Horovod
    user gets by passing ``compression=hvd.Compression.fp16``. Sparse gradients, and dense ones sent
    as rows, keep their config (Horovod's fp16 cannot take them, see ``twin``)."""
    configs = {name: strategy.config_for(name) for name in variables}
    return _build(variables, {name: dataclasses.replace(config, compression="fp16")
                              if not variables[name].sparse and not config.rows
                              and variables[name].dtype in FLOATING_DTYPES else config
                              for name, config in configs.items()})


def with_rows(name: str, variables: Mapping[str, VariableInfo], num_servers: int, rows: frozenset[str]) -> Strategy:
    """Baseline ``name`` built as if the dense embeddings ``rows`` were sparse, each sending its
    nonzero rows (``VarConfig.rows``) where the builder sends a sparse gradient: Horovod's sparse
    all-gather on the all-reduce route (a ring, alone: what Horovod does with any sparse gradient,
    hierarchical or not), whole or sharded on the PS. It is what a user gets by turning those
    embeddings into ``nn.Embedding(sparse=True)``, and it computes the same sums."""
    missing = sorted(rows - set(variables))
    if missing or not rows:
        raise ValueError(f"a rows twin needs the model's dense embeddings; got {sorted(rows)}"
                         + (f" (not variables of the model: {', '.join(missing)})" if missing else ""))
    as_sparse = {n: dataclasses.replace(info, sparse=True) if n in rows else info for n, info in variables.items()}
    strategy = build_baseline(name, as_sparse, num_servers)
    configs = {n: strategy.config_for(n) for n in variables}
    for n in rows:
        configs[n] = (VarConfig(route="allreduce", rows=True) if configs[n].route == "allreduce"
                      else dataclasses.replace(configs[n], rows=True, compression=None))
    return _build(variables, configs)


FP16_SUFFIX = "-fp16"
ROWS_SUFFIX = "-rows"
TWINS = ("allreduce", "hierarchical", "horovod-hierarchical", "parallax")
"""Baselines with twins (``<name>-fp16``, ``<name>-rows``, ``<name>-rows-fp16``): the fair rivals of a
strategy that uses fp16, rows or both."""
NOT_RUNNABLE_SPARSE_FP16 = ("Horovod 0.28.1's compression=hvd.Compression.fp16 crashes on sparse gradients "
                            "(decompress gets no dtype)")


def horovod_fp16_blocker(variables: Mapping[str, VariableInfo], *, as_rows: bool = False) -> str | None:
    """Why Horovod's ``Compression.fp16`` cannot run on this model, or ``None``: Horovod 0.28.1 crashes on
    any sparse gradient, and a model has some if a variable is sparse or its dense embeddings are sent
    as rows (``as_rows``: a rows twin). The one rule for Horovod's fp16 reference row, the ``allreduce``
    fp16 twins and the trial worker."""
    return NOT_RUNNABLE_SPARSE_FP16 if as_rows or any(info.sparse for info in variables.values()) else None


def twin_names(*, fp16: bool, rows: bool) -> list[str]:
    """The twins' names with these levers: ``<name>-fp16``, ``<name>-rows`` and, with both, ``<name>-rows-fp16``."""
    suffixes = ([FP16_SUFFIX] if fp16 else []) + ([ROWS_SUFFIX] if rows else []) + (
        [ROWS_SUFFIX + FP16_SUFFIX] if fp16 and rows else [])
    return [name + suffix for suffix in suffixes for name in TWINS]


def split_twin(name: str) -> tuple[str, frozenset[str]]:
    """A baseline name's builder and its twin's levers: ``"parallax-rows-fp16"`` -> ``("parallax", {rows, fp16})``."""
    levers = set()
    if name.endswith(FP16_SUFFIX):
        name, levers = name.removesuffix(FP16_SUFFIX), {"fp16"}
    if name.endswith(ROWS_SUFFIX):
        name, levers = name.removesuffix(ROWS_SUFFIX), levers | {"rows"}
    return name, frozenset(levers)


def twin(name: str, variables: Mapping[str, VariableInfo], num_servers: int, *, fp16: bool,
         rows: frozenset[str] | None = None) -> Strategy:
    """Baseline ``name`` with fp16 on its dense gradients (``fp16``) and/or the dense embeddings
    ``rows`` sent as rows (``None``: no rows twin); ``ValueError`` where the twin cannot run.

    The ``allreduce`` fp16 twin is Horovod with ``Compression.fp16`` (every gradient fp16), which
    Horovod cannot run on a model with sparse gradients, rows twin included: no Horovod user has
    that rival then.
    """
    if name not in TWINS:
        raise ValueError(f"baseline {name!r} has no twins (twins of: {', '.join(TWINS)})")
    blocker = horovod_fp16_blocker(variables, as_rows=rows is not None) if fp16 and name == "allreduce" else None
    if blocker:
        raise ValueError(f"not runnable: {blocker}")
    strategy = (build_baseline(name, variables, num_servers) if rows is None
                else with_rows(name, variables, num_servers, rows))
    return with_fp16(strategy, variables) if fp16 else strategy


def fp16_twin(name: str, variables: Mapping[str, VariableInfo], num_servers: int) -> Strategy:
    """Baseline ``name`` with fp16 on its dense gradients (``twin`` without rows)."""
    return twin(name, variables, num_servers, fp16=True)


def _check_servers(num_servers: int) -> None:
    if not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an integer >= 1, got {num_servers!r}")


BUILDERS = {"allreduce": all_allreduce, "hierarchical": all_hierarchical,
            "horovod-hierarchical": horovod_hierarchical, "ps": all_ps, "ps-lb": load_balanced_ps,
            "ps-partitioned": partitioned_ps, "parallax": parallax}
"""Builder name -> function, for the command line."""
NEEDS_SERVERS = frozenset({"ps", "ps-lb", "ps-partitioned", "parallax"})
"""Builders that take ``num_servers`` (their strategies route variables to parameter servers)."""


def build_baseline(name: str, variables: Mapping[str, VariableInfo], num_servers: int,
                   rows: frozenset[str] = frozenset()) -> Strategy:
    """The baseline ``name`` (a builder, or a twin ``<builder>[-rows][-fp16]``) for ``variables``;
    ``num_servers`` is used only by the PS builders, ``rows`` (the dense embeddings) only by rows twins."""
    builder, twin_levers = split_twin(name)
    if twin_levers and builder in TWINS:
        return twin(builder, variables, num_servers, fp16="fp16" in twin_levers,
                    rows=rows if "rows" in twin_levers else None)
    if name not in BUILDERS:
        raise ValueError(f"unknown baseline {name!r} (known: {', '.join(BUILDERS)}, and the twins "
                         f"{', '.join(twin_names(fp16=True, rows=True))})")
    return BUILDERS[name](variables, num_servers=num_servers) if name in NEEDS_SERVERS else BUILDERS[name](variables)


def levers(strategy: Strategy | None, variables: Mapping[str, VariableInfo]) -> frozenset[str]:
    """What a strategy uses beyond what plain Horovod sends on ``variables``: ``fp16`` (compression on
    some variable), ``rows`` (a dense gradient sent as its nonzero rows) and ``async`` (ASP/SSP or a
    switching policy on the PS). A rival is fair to a strategy when it uses no lever the strategy
    does not use."""
    if strategy is None:
        return frozenset()
    configs = [strategy.config_for(name) for name in variables]
    out = set()
    if any(c.compression == "fp16" for c in configs):
        out.add("fp16")
    if any(c.rows for c in configs):
        out.add("rows")
    if any(c.route == "ps" and c.protocol != "bsp" for c in configs) or (
            strategy.sync is not None and strategy.sync.policy != "static"):
        out.add("async")
    return frozenset(out)
