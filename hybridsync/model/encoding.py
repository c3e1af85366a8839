"""The runtime simulator's input: many candidates of one (model description, cluster) at once.

The simulator scores thousands of candidate strategies per second, which per-strategy
Python objects (``Strategy``, ``build_plan``) cannot do. This module turns a model
description into per-variable arrays (``ModelArrays``) and candidate strategies into the
strategy space's ``StrategyBatch`` arrays (candidates x variables, one per knob of
``hybridsync.knobs``) for a cluster, then reduces a batch to *units*:
the messages of each candidate as the router sends them, one unit per ungrouped variable
(its shards) and one per merge group (the k-th shards of its members, as ``build_plan``
fuses them), with bytes, message count, ready time and route (``Units``).

A search can mutate ``StrategyBatch`` arrays directly (``from_strategies`` walks every
variable of every strategy in Python; ``to_strategy`` turns a winner back into a
``Strategy``). Torch-free; numpy only.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from hybridsync import knobs
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import ModelDescription
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.strategy_space.batch import (FP16, HIER, PS, RING, ROUTE_VARIANTS, StrategyBatch,  # noqa: F401
                                             empty_batch)
from hybridsync.strategy_space.sample import is_embedding_like
from hybridsync.variables import FLOATING_DTYPES

PS_ASYNC, GATHER = 3, 4
"""Unit routes beyond ``StrategyBatch``'s (``RING``, ``HIER``, ``PS``: BSP): ASP/SSP parameter servers,
and Horovod's all-gather of a whole sparse gradient's touched rows (ring route, not merged or split)."""
ROUTE_NAMES = ("ring", "hier", "ps", "ps_async", "gather")
INDEX_BYTES = 8
"""Each touched row of a sparse gradient travels with an int64 index."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArrays:
    """A profiled model description as per-variable arrays (the description's variable order)."""

    name: str
    names: tuple[str, ...]
    nbytes: np.ndarray
    """Dense gradient bytes per variable."""
    rows: np.ndarray
    """Rows along dim 0 (1 for scalars): the most shards a variable can have."""
    floating: np.ndarray
    """Whether fp16 compression halves the variable's bytes."""
    sparse: np.ndarray
    sparse_bytes: np.ndarray
    """Bytes of a step's touched rows with their indices (sparse variables; else 0)."""
    dense_rows_bytes: np.ndarray
    """Dense floating variables: bytes of a step's nonzero rows with their indices, as ``rows`` sends
    them (``rows_touched``, else every row: more than the dense size); else 0."""
    embedding_like: np.ndarray
    """Where ``rows`` may pay (``strategy_space.is_embedding_like``): the search's rows move goes only there."""
    ready_s: np.ndarray
    """Seconds from the start of the backward pass to the gradient being ready (single process)."""
    ready_order: np.ndarray
    """Variable indices in the order their gradients become ready (ties: description order)."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    other_s: float
    """The rest of a profiled step (data, zero_grad...): ``step_s`` minus the three phases."""

    @property
    def num_variables(self) -> int:
        return len(self.names)


def model_arrays(description: ModelDescription) -> ModelArrays:
    """The arrays of a profiled description; ``ValueError`` if it has no compute timing.

    A variable without gradient timing is taken as ready at the end of the backward pass;
    a sparse variable without ``rows_touched`` as touching every row (its dense size), and a
    dense one sent as rows (``VarConfig.rows``) without it as every row nonzero.
    """
    timing = description.timing
    label = description.name or "model description"
    if timing is None:
        raise ValueError(f"{label}: has no compute timing; the simulator needs a profiled description "
                         f"(hybridsync profile -o desc.json -- python train.py)")
    if not description.variables:
        raise ValueError(f"{label}: has no variables")
    infos = list(description.variables.values())
    nbytes = np.array([info.nbytes for info in infos], dtype=np.float64)
    rows = np.array([info.shape[0] if info.shape else 1 for info in infos], dtype=np.int64)
    sparse = np.array([info.sparse for info in infos], dtype=bool)
    sparse_bytes = np.zeros(len(infos))
    dense_rows_bytes = np.zeros(len(infos))
    ready = np.full(len(infos), timing.backward_s)
    embedding = np.zeros(len(infos), dtype=bool)
    for i, info in enumerate(infos):
        var_timing = description.variable_timing.get(info.name)
        if var_timing is not None:
            ready[i] = var_timing.ready_s
        profiled = var_timing.rows_touched if var_timing else None
        embedding[i] = is_embedding_like(info, profiled)
        touched = profiled if profiled is not None else rows[i]
        row_bytes = nbytes[i] / max(rows[i], 1)
        if info.sparse:
            sparse_bytes[i] = touched * (row_bytes + INDEX_BYTES)
        elif info.dtype in FLOATING_DTYPES:
            dense_rows_bytes[i] = touched * (row_bytes + INDEX_BYTES)
    other = max(0.0, timing.step_s - timing.forward_s - timing.backward_s - timing.optimizer_s)
    return ModelArrays(name=description.name or "", names=tuple(description.variables), nbytes=nbytes, rows=rows,
                       floating=np.array([info.dtype in FLOATING_DTYPES for info in infos]), sparse=sparse,
                       sparse_bytes=sparse_bytes, dense_rows_bytes=dense_rows_bytes,
                       embedding_like=embedding, ready_s=ready,
                       ready_order=np.argsort(ready, kind="stable"), forward_s=timing.forward_s,
                       backward_s=timing.backward_s, optimizer_s=timing.optimizer_s, other_s=other)


def from_strategies(arrays: ModelArrays, strategies: Sequence[Strategy | None], cluster: ClusterSpec, *,
                    compression: str = "none") -> StrategyBatch:
    """Encode ``strategies`` (``None``: plain Horovod, every variable ring) for ``cluster``.

    ``compression`` is the optimizer's default for configs that name none. ``ValueError``
    when a strategy routes a variable to parameter servers the cluster does not have.
    """
    batch = empty_batch(len(strategies), arrays.num_variables, cluster.num_servers)
    cache: dict[VarConfig, tuple] = {}
    known = set(arrays.names)
    for i, strategy in enumerate(strategies):
        if strategy is None:
            continue
        unknown = [name for name in strategy.variables if name not in known]
        if unknown:
            raise ValueError(f"strategy {i} configures {unknown[0]!r}, which is not a variable of "
                             f"{arrays.name or 'the model'}")
        groups: dict[int, int] = {}
        for j, name in enumerate(arrays.names):
            config = strategy.config_for(name)
            codes = cache.get(config)
            if codes is None:
                codes = cache[config] = _config_codes(config, cluster, compression, name)
            route, protocol, parts, fp16, share = codes
            batch.route[i, j], batch.protocol[i, j], batch.partitions[i, j] = route, protocol, parts
            batch.staleness[i, j] = config.staleness or 0
            batch.fp16[i, j] = fp16 and arrays.floating[j]
            batch.rows[i, j] = config.rows
            if share is not None:
                batch.server_share[i, j] = share
            if config.group is not None:
                batch.group[i, j] = groups.setdefault(config.group, len(groups))
    too_many = np.argwhere(batch.partitions > arrays.rows)
    if len(too_many):
        i, j = too_many[0]
        raise ValueError(f"strategy {i}: variable {arrays.names[j]!r} has {arrays.rows[j]} rows, "
                         f"fewer than its {batch.partitions[i, j]} partitions")
    return batch


def as_run_on(batch: StrategyBatch, cluster: ClusterSpec) -> StrategyBatch:
    """``batch`` as the runtime sends it on ``cluster``: with one rank per node hierarchical all-reduce
    goes the ring's way (``ClusterSpec.hierarchical_is_ring``), so it is priced as the ring. Trials keep
    the codes they were encoded with (``from_strategies``): those of such clusters measured before the
    runtime sent it so (2026-11-29) ran the hierarchical backend."""
    hierarchical = batch.route == HIER
    if not cluster.hierarchical_is_ring or not hierarchical.any():
        return batch
    return dataclasses.replace(batch, route=np.where(hierarchical, RING, batch.route).astype(batch.route.dtype))


def _config_codes(config: VarConfig, cluster: ClusterSpec, compression: str, name: str) -> tuple:
    fp16 = knobs.COMPRESSION.code(config.compression or compression) == FP16
    if config.route != "ps":
        return ROUTE_VARIANTS.index(("allreduce", config.algorithm)), 0, config.partitions, fp16, None
    if cluster.num_servers == 0:
        raise ValueError(f"variable {name!r} is routed to the parameter servers, but the cluster has none "
                         f"(servers_per_node: 0); give the cluster servers or route it to all-reduce")
    share = None
    if config.servers is not None:
        bad = [s for s in config.servers if s >= cluster.num_servers]
        if bad:
            raise ValueError(f"variable {name!r} names server {bad[0]}, but the cluster has "
                             f"{cluster.num_servers} servers (0..{cluster.num_servers - 1})")
        share = np.bincount(config.servers, minlength=cluster.num_servers) / len(config.servers)
    return PS, knobs.PROTOCOL.code(config.protocol), config.partitions, fp16, share


@dataclasses.dataclass(frozen=True, kw_only=True)
class Units:
    """Each candidate's messages, gathered per unit: (N, V) arrays whose columns follow the
    variables' ready order (``ModelArrays.ready_order``), so a channel serves them left to right.

    Column j holds the unit of the j-th gradient to become ready: that variable's shards
    when it is in no group; the whole group's messages when it is the group's last-ready
    member (a merged message leaves when its last gradient is ready); else nothing
    (``messages == 0``).
    """

    route: np.ndarray
    """int8 route code (``RING``... ``GATHER``)."""
    wire_bytes: np.ndarray
    """Bytes per worker and direction: dense size after compression, touched rows for sparse
    gradients on the BSP parameter servers and on Horovod's all-gather, dense uncompressed
    parameters under ASP/SSP."""
    messages: np.ndarray
    """Messages the unit sends (a variable's shards; a group's largest shard count)."""
    pieces: np.ndarray
    """Shards of all its variables: ASP/SSP send every piece's parameters as a key of its own."""
    keys: np.ndarray
    """Parameter-server keys of PS units (each message, or each ASP/SSP piece, cut into
    chunks of at most ``partition_bytes``); 0 for the other routes."""
    ready_s: np.ndarray
    """When the unit's last gradient is ready, from the start of the backward pass (single process)."""
    sparse_bytes: np.ndarray
    """The part of ``wire_bytes`` that is touched rows."""
    server_bytes: np.ndarray
    """(N, S): bytes each server holds by explicit placement (PS units)."""
    balanced_bytes: np.ndarray
    """(N,): PS bytes placed by balancing (no explicit servers)."""
    largest_key: np.ndarray
    """(N,): the largest balanced PS key's bytes (placement granularity)."""
    fp16_bytes: np.ndarray
    """(N,): bytes sent as float16."""
    fp16_ps_bytes: np.ndarray
    """(N,): the part of ``fp16_bytes`` sent to the BSP parameter servers."""
    densified_bytes: np.ndarray
    """(N,): dense bytes of sparse gradients sent whole (split, merged or hierarchical: the
    router densifies them every step, a CPU cost on every rank)."""
    fp16_pieces: np.ndarray
    """(N,): pieces sent as float16 (a cast each way, per piece, on every rank)."""
    merged_pieces: np.ndarray
    """(N,): pieces that travel in a merge group (copied into the message's flat buffer and back by
    the router, or handed to Horovod as one grouped all-reduce that waits for all of them)."""


def units(arrays: ModelArrays, batch: StrategyBatch, *, partition_bytes: int) -> Units:
    """Reduce a batch to units (see ``Units``); ``partition_bytes`` is the PS key size."""
    n, v = batch.route.shape
    parts = np.maximum(batch.partitions, 1)
    grouped = batch.group >= 0
    is_ps = batch.route == PS
    sparse = np.broadcast_to(arrays.sparse, (n, v))
    as_rows = sparse | batch.rows  # sparse, or dense sent as its nonzero rows (``VarConfig.rows``)
    asynchronous = is_ps & (batch.protocol > 0)
    gather = as_rows & (batch.route == RING) & (parts == 1) & ~grouped
    touched = as_rows & ((is_ps & ~asynchronous) | gather)
    # ASP/SSP push parameter deltas and pull values: dense and uncompressed (router.plan)
    dense = np.where(batch.fp16 & ~asynchronous, arrays.nbytes * 0.5, arrays.nbytes)
    wire = np.where(touched, np.where(sparse, arrays.sparse_bytes, arrays.dense_rows_bytes), dense)
    # PS placement is a sum over variables: in description order, like the batch
    ps_wire = np.where(is_ps, wire, 0.0)
    share = _group_placement(batch.server_share, batch.group)
    explicit = share.sum(axis=2) > 0
    server_bytes = np.einsum("nv,nvs->ns", np.where(explicit, ps_wire, 0.0), share)
    balanced = np.where(explicit, 0.0, ps_wire)
    key = np.minimum(balanced / parts, partition_bytes)
    fp16_sent = np.where(batch.fp16 & ~touched & ~asynchronous, dense, 0.0)
    fp16_bytes, fp16_ps_bytes = fp16_sent.sum(axis=1), np.where(is_ps, fp16_sent, 0.0).sum(axis=1)
    densified_bytes = np.where(sparse & ~touched & ~asynchronous, arrays.nbytes, 0.0).sum(axis=1)
    fp16_pieces = np.where(fp16_sent > 0, parts, 0).sum(axis=1)
    merged_pieces = np.where(grouped & ~asynchronous, parts, 0).sum(axis=1)

    order = arrays.ready_order  # units: columns in ready order
    route = np.where(gather, GATHER, np.where(asynchronous, PS_ASYNC, batch.route))
    route, wire, parts = route[:, order].astype(np.int8), wire[:, order], parts[:, order]
    grouped, touched, group = grouped[:, order], touched[:, order], batch.group[:, order]
    unit_bytes = np.where(grouped, 0.0, wire)
    unit_messages = np.where(grouped, 0, parts)
    unit_pieces = unit_messages.copy()
    unit_sparse = np.where(grouped | ~touched, 0.0, wire)
    if grouped.any():
        num_groups = int(group.max()) + 1
        rows, cols = np.nonzero(grouped)
        flat = rows * num_groups + group[rows, cols]
        size = n * num_groups
        owner = np.full(size, -1)
        np.maximum.at(owner, flat, cols)  # the group's last-ready member carries its unit
        g_messages = np.zeros(size, np.int64)
        np.maximum.at(g_messages, flat, parts[rows, cols])
        used = np.unique(flat)
        owner_rows, owner_cols = used // num_groups, owner[used]
        unit_bytes[owner_rows, owner_cols] = np.bincount(flat, wire[rows, cols], size)[used]
        unit_sparse[owner_rows, owner_cols] = np.bincount(flat, np.where(touched, wire, 0.0)[rows, cols], size)[used]
        unit_messages[owner_rows, owner_cols] = g_messages[used]
        unit_pieces[owner_rows, owner_cols] = np.bincount(flat, parts[rows, cols], size)[used]
    keys = np.where(route == PS, _chunks(unit_bytes, unit_messages, partition_bytes),
                    np.where(route == PS_ASYNC, _chunks(unit_bytes, unit_pieces, partition_bytes), 0.0))
    return Units(route=route, wire_bytes=unit_bytes, messages=unit_messages, pieces=unit_pieces, keys=keys,
                 ready_s=np.broadcast_to(arrays.ready_s[order], (n, v)), sparse_bytes=unit_sparse,
                 server_bytes=server_bytes, balanced_bytes=balanced.sum(axis=1),
                 largest_key=key.max(axis=1) if v else np.zeros(n),
                 fp16_bytes=fp16_bytes, fp16_ps_bytes=fp16_ps_bytes, densified_bytes=densified_bytes,
                 fp16_pieces=fp16_pieces, merged_pieces=merged_pieces)


def _group_placement(share: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Server shares with each merge group's members placed as its first member says: a merged
    message goes where the first variable's config sends that shard (``build_plan`` takes the
    config of a group's first member; exact when the members have equal partitions)."""
    grouped = group >= 0
    if not grouped.any() or not share[grouped].any():
        return share  # no merged variable is placed explicitly
    n, v = group.shape
    num_groups = int(group.max()) + 1
    rows, cols = np.nonzero(grouped)
    flat = rows * num_groups + group[rows, cols]
    first = np.full(n * num_groups, v)
    np.minimum.at(first, flat, cols)
    out = share.copy()
    out[rows, cols] = share[rows, first[flat]]
    return out


def _chunks(wire_bytes: np.ndarray, messages: np.ndarray, partition_bytes: int) -> np.ndarray:
    """Keys of ``messages`` equal messages of ``wire_bytes`` in all, each cut into chunks of at
    most ``partition_bytes`` (``placement.chunk_message``)."""
    per_message = np.where(messages > 0, wire_bytes / np.maximum(messages, 1), 0.0)
    return messages * np.maximum(1, np.ceil(per_message / partition_bytes))
