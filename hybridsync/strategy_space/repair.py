"""The repair: the nearest candidates within ``SpaceBounds``, with merge groups in a canonical form.

The sampler repairs what it draws and the search what it mutates and crosses, so every
candidate either proposes is one ``StrategyBatch.to_strategy`` turns into a valid ``Strategy``,
and equal strategies have equal rows (merge groups numbered by their first member, no group of
one). Torch-free; numpy only.
"""
from __future__ import annotations

import numpy as np

from hybridsync import knobs
from hybridsync.strategy_space.batch import (BSP, HIER, MESSAGE_KINDS, PS, RING, SSP, StrategyBatch, VariableArrays,
                                             message_kind)
from hybridsync.strategy_space.bounds import SpaceBounds


def repair(batch: StrategyBatch, arrays: VariableArrays, bounds: SpaceBounds) -> StrategyBatch:
    """The nearest candidates within ``bounds`` (a new batch):

    routes the cluster lacks become ring; partitions within the variable's rows and
    ``max_partitions``; fp16 only for floating variables; protocol and staleness only on the
    PS (SSP staleness >= 0); sparse gradients all-reduced as Horovod's all-gather (ring, one
    message, no group, no fp16) unless ``densify_sparse``; explicit server shares that are
    not whole shards, or name servers that do not exist, become balanced; the server-memory
    bound; ``exact``: no fp16 and BSP only; then merge groups split into one group per message
    kind, groups of one dissolved and groups numbered by their first member; last, ``rows`` kept
    only where a dense gradient can travel as its rows (``rows_valid``).
    """
    route = batch.route.astype(np.int8, copy=True)
    if not bounds.hierarchical:
        route[route == HIER] = RING
    if bounds.num_servers == 0:
        route[route == PS] = RING
    partitions = np.clip(batch.partitions, knobs.PARTITIONS.minimum, np.minimum(arrays.rows, bounds.max_partitions))
    fp16 = batch.fp16 & arrays.floating & (not bounds.exact)
    group = batch.group.copy()
    share = _repair_shares(batch.server_share, route, partitions, bounds)
    if bounds.server_memory_bytes is not None:
        _fit_server_memory(route, share, arrays, bounds)
    if not bounds.densify_sparse:
        gather = arrays.sparse & (route != PS)
        route[gather], partitions[gather], fp16[gather], group[gather] = RING, 1, False, -1
    on_ps = route == PS
    protocol = np.where(on_ps & (not bounds.exact), batch.protocol, BSP).astype(np.int8)
    staleness = np.where(on_ps & (protocol == SSP), np.maximum(batch.staleness, knobs.STALENESS.minimum), 0)
    repaired = StrategyBatch(route=route, protocol=protocol, staleness=staleness, partitions=partitions,
                             group=group, fp16=fp16, server_share=share)
    repaired.group[:] = canonical_groups(repaired)
    repaired.rows[:] = batch.rows & rows_valid(repaired, arrays)
    return repaired


def rows_valid(batch: StrategyBatch, arrays: VariableArrays) -> np.ndarray:
    """Where ``rows`` may hold (``knobs.ROWS``, ``Strategy.validate_for``): a dense floating variable of
    more than one row, without fp16, on the BSP parameter servers or alone on the ring (one shard, no group)."""
    alone_on_ring = (batch.route == RING) & (batch.partitions == 1) & (batch.group < 0)
    bsp = (batch.route == PS) & (batch.protocol == BSP)
    return (alone_on_ring | bsp) & ~batch.fp16 & ~arrays.sparse & arrays.floating & (arrays.rows > 1)


def _repair_shares(share: np.ndarray, route: np.ndarray, partitions: np.ndarray, bounds: SpaceBounds) -> np.ndarray:
    width = max(bounds.num_servers, 1)
    out = np.zeros(route.shape + (width,))
    kept = min(width, share.shape[2])
    rows, cols = np.nonzero((route == PS) & share.any(axis=2))  # explicit placements only
    if len(rows) == 0:
        return out
    parts = partitions[rows, cols][:, None]
    counts = share[rows, cols] * parts
    whole = np.rint(counts[:, :kept])
    valid = ((np.abs(counts[:, :kept] - whole) < 1e-6).all(axis=1) & (whole.sum(axis=1) == parts[:, 0])
             & (counts[:, kept:].sum(axis=1) == 0))
    out[rows[valid], cols[valid]] = whole[valid] / parts[valid]
    return out


def _fit_server_memory(route: np.ndarray, share: np.ndarray, arrays: VariableArrays, bounds: SpaceBounds) -> None:
    """In place: candidates whose servers would hold more than ``server_memory_bytes`` each get a
    balanced placement, then lose their largest PS variables to ring all-reduce until the
    servers' total capacity holds the rest (balancing spreads bytes within a shard of even)."""
    capacity = float(bounds.server_memory_bytes)
    on_ps = route == PS
    ps_bytes = np.where(on_ps, arrays.nbytes, 0.0)
    explicit = share.sum(axis=2) > 0
    load = (np.einsum("nv,nvs->ns", np.where(explicit, ps_bytes, 0.0), share)
            + np.where(explicit, 0.0, ps_bytes).sum(axis=1, keepdims=True) / bounds.num_servers)
    over = load.max(axis=1) > capacity
    share[over] = 0.0
    largest_first = np.argsort(-arrays.nbytes, kind="stable")
    ordered = ps_bytes[:, largest_first]
    before = np.cumsum(ordered, axis=1) - ordered  # PS bytes of larger variables
    total = ordered.sum(axis=1, keepdims=True)
    evict = np.zeros_like(on_ps)
    evict[:, largest_first] = (ordered > 0) & (total - before > capacity * bounds.num_servers) & over[:, None]
    route[evict] = RING
    share[evict] = 0.0


def canonical_groups(batch: StrategyBatch) -> np.ndarray:
    """The batch's merge groups split by message kind, without groups of one member, numbered
    0, 1, ... by their first member in variable order within each candidate (as
    ``from_strategies`` numbers a strategy's groups)."""
    n, v = batch.group.shape
    out = np.full((n, v), -1, np.int64)
    rows, cols = np.nonzero(batch.group >= 0)
    if len(rows) == 0:
        return out
    labels = int(batch.group.max()) + 1
    key = (rows * labels + batch.group[rows, cols]) * MESSAGE_KINDS + message_kind(batch)[rows, cols]
    unique, first, inverse, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    shared = counts > 1
    order = np.argsort(np.where(shared, first, np.iinfo(np.int64).max), kind="stable")[:shared.sum()]
    group_rows = rows[first[order]]  # non-decreasing: ``first`` follows the row-major nonzero order
    label = np.full(len(unique), -1, np.int64)
    label[order] = np.arange(len(order)) - np.searchsorted(group_rows, group_rows, side="left")
    out[rows, cols] = label[inverse]
    return out


