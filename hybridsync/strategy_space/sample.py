"""The one sampler of the strategy space: random valid strategies, for trials and the search.

A strategy is drawn in two levels, so that the samples cover pure strategies, mixes that
lean one way, and even mixes alike (a flat per-variable draw would make every sample an
even mix of everything):

1. strategy-level: route weights (a Dirichlet draw over the routes the bounds allow), the PS
   protocol, how often fp16 is used, the number of merge groups and the partition size, each
   from its knob's ``draw`` (``hybridsync.knobs``);
2. per variable: a route drawn from those weights (or, in ``BY_CLASS`` of the strategies,
   one route per class of variable: sparse, large dense, small dense), then its partitions,
   compression and (for the PS, in some strategies) an explicit server placement.

Merge groups are formed afterwards in backward order (last variable first, as gradients
become ready) among the variables that can share a message. ``sample`` draws a batch with
whole-array numpy operations (the search draws thousands at once); ``random_strategy`` is one
draw of it as a ``Strategy``. Randomness only from the ``numpy.random.Generator`` passed in.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from hybridsync import knobs
from hybridsync.description import FLOATING_DTYPES, VariableInfo
from hybridsync.strategy import Strategy
from hybridsync.strategy_space.batch import (PS, StrategyBatch, VariableArrays, empty_batch, message_kind,
                                             variable_arrays)
from hybridsync.strategy_space.bounds import SpaceBounds
from hybridsync.strategy_space.repair import repair

BY_CLASS = 0.4
"""Share of strategies that route by variable class (sparse, large dense, small dense) rather
than variable by variable: the hand-made mixes that work (Parallax; embeddings on the PS and
dense layers hierarchical and fused) are of that kind, and a per-variable draw almost never
produces one."""
LARGE_DENSE_BYTES = 1024 * 1024
CLASSES = ("sparse", "large", "small")
"""The classes of variable that hand-made mixes treat alike (``BY_CLASS``, ``search.seeds``, the
search's class-wide moves): sparse, large dense (>= ``LARGE_DENSE_BYTES``), small dense."""


def variable_class(info: VariableInfo) -> str:
    """``info``'s class, one of ``CLASSES``."""
    if info.sparse:
        return "sparse"
    return "large" if info.nbytes >= LARGE_DENSE_BYTES else "small"


ROWS_SHARE = 0.25
"""A large dense variable is embedding-like when a profiled step touches at most this share of its
rows: sent as those rows (``VarConfig.rows``) it then travels in well under half its fp16 bytes."""


def is_embedding_like(info: VariableInfo, rows_touched: int | None) -> bool:
    """Whether ``info`` is a dense embedding (``nn.Embedding(sparse=False)``) whose nonzero rows are
    worth sending alone: large, floating, more than one row, and its profiled ``rows_touched``
    at most ``ROWS_SHARE`` of them (measured, never guessed from a name; None: not profiled).
    The one rule for where ``rows`` may pay: the search's rows move, the seeds and the rivals'
    rows twins all use it, so the winner never sends rows where no rival may."""
    return (rows_touched is not None and variable_class(info) == "large" and info.dtype in FLOATING_DTYPES
            and len(info.shape) >= 1 and info.shape[0] > 1 and rows_touched <= ROWS_SHARE * info.shape[0])


def variable_classes(arrays: VariableArrays) -> np.ndarray:
    """Each variable's class as its index in ``CLASSES``."""
    return np.where(arrays.sparse, 0, np.where(arrays.nbytes >= LARGE_DENSE_BYTES, 1, 2))


def random_strategy(variables: Mapping[str, VariableInfo], bounds: SpaceBounds,
                    rng: np.random.Generator) -> Strategy:
    """One random valid strategy for ``variables`` within ``bounds`` (one draw of ``sample``)."""
    arrays = variable_arrays(variables)
    return sample(arrays, bounds, rng, 1).to_strategy(0, arrays.names)


def sample(arrays: VariableArrays, bounds: SpaceBounds, rng: np.random.Generator, n: int) -> StrategyBatch:
    """``n`` random candidates, repaired."""
    v, codes = len(arrays.names), np.array(bounds.routes, dtype=np.int8)
    batch = empty_batch(n, v, bounds.num_servers)
    weights = rng.standard_gamma(knobs.ROUTE.draw[0], size=(n, len(codes))) + 1e-12  # Dirichlet(0.6, ...)
    cdf = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
    draws = (rng.random((n, v, 1)) > cdf[:, None, :]).sum(axis=2)
    by_class = rng.random(n) < BY_CLASS
    if by_class.any():  # one route per class of variable: sparse, large dense, small dense
        klass = variable_classes(arrays)
        class_draws = (rng.random((n, 3, 1)) > cdf[:, None, :]).sum(axis=2)
        draws[by_class] = class_draws[by_class][:, klass]
    batch.route[:] = codes[np.minimum(draws, len(codes) - 1)]
    protocol, staleness = draw_protocols(rng, n)
    batch.protocol[:], batch.staleness[:] = protocol[:, None], staleness[:, None]
    fp16_share = rng.choice(knobs.COMPRESSION.draw, size=n)
    batch.fp16[:] = rng.random((n, v)) < fp16_share[:, None]
    sizes = np.array([np.inf if b is None else b for b in knobs.PARTITIONS.draw])
    partition_bytes = sizes[rng.integers(len(sizes), size=n)]
    parts = np.ceil(arrays.nbytes / partition_bytes[:, None])
    batch.partitions[:] = np.where(arrays.nbytes > partition_bytes[:, None], parts, 1).astype(np.int64)
    batch.partitions[:] = np.clip(batch.partitions, 1, np.minimum(arrays.rows, bounds.max_partitions))
    if bounds.num_servers > 0:
        explicit = (rng.random(n) < knobs.SERVERS.draw[0])[:, None] & (batch.route == PS)
        rows, cols = np.nonzero(explicit)
        parts = batch.partitions[rows, cols]
        counts = rng.multinomial(parts, np.full(bounds.num_servers, 1.0 / bounds.num_servers))
        batch.server_share[rows, cols] = counts / parts[:, None]
    num_groups = rng.choice(knobs.GROUP.draw, size=n)
    batch = repair(batch, arrays, bounds)  # message kinds settle first (sparse all-gather, routes)
    batch.group[:] = _contiguous_groups(batch, num_groups)
    return repair(batch, arrays, bounds)


def draw_protocols(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` PS protocol codes and their stalenesses (0 but under SSP), as ``knobs.PROTOCOL.draw``
    and ``knobs.STALENESS.draw`` say: mostly BSP; sometimes ASP, or SSP with a staleness of 1-3 steps."""
    cdf = np.cumsum(knobs.PROTOCOL.draw)[:-1]
    protocol = (rng.random(n)[:, None] >= cdf).sum(axis=1).astype(np.int8)
    stalenesses = np.array(knobs.STALENESS.draw)
    staleness = np.where(protocol == knobs.PROTOCOL.code("ssp"), stalenesses[rng.integers(len(stalenesses), size=n)],
                         0)
    return protocol, staleness


def _contiguous_groups(batch: StrategyBatch, num_groups: np.ndarray) -> np.ndarray:
    """Each message kind of each candidate split (backward order) into ``num_groups`` runs; 0
    groups: none. Variables that must stay alone (sparse all-gather) are grouped here and split
    off again by ``repair``."""
    n, v = batch.route.shape
    kind = message_kind(batch)
    _, kind = np.unique(kind, return_inverse=True)
    kind = kind.reshape(n, v)
    onehot = kind[:, :, None] == np.arange(kind.max() + 1)
    behind = np.cumsum(onehot[:, ::-1], axis=1)[:, ::-1]  # members of the kind at or after each variable
    position = np.take_along_axis(behind, kind[:, :, None], axis=2)[:, :, 0] - 1
    count = np.take_along_axis(behind[:, 0, :], kind, axis=1)
    run = np.ceil(count / np.maximum(num_groups, 1)[:, None])
    group = kind * (v + 1) + position // run
    return np.where(num_groups[:, None] > 0, group, -1).astype(np.int64)
