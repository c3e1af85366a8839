"""The search's operators on ``StrategyBatch`` arrays: sample, mutate, crossover, repair, keys.

A search that scores 10,000 candidates a second cannot build ``Strategy`` objects for them,
so every operator here works on whole batches (candidates x variables) with numpy:

- ``sample``: random candidates drawn as ``space.random_strategy`` draws them (two levels:
  strategy-level route weights or one route per class of variable, protocol, fp16 share,
  partition size, merge group count; then each variable), without Python per variable;
- ``mutate``: the moves of a person tuning by hand (route/algorithm, partitions x2 or /2,
  regroup, fp16, the PS protocol of every PS variable, a shard to another server, one
  variable's settings spread to its neighbours), and the same for a whole class of variable
  at once (sparse, large dense, small dense: its route, its fp16, fused or not);
- ``crossover``: each variable's settings from one parent or the other;
- ``repair``: the nearest candidate within ``SpaceBounds`` (see its docstring), with merge
  groups in a canonical form (numbered by first member, no group of one) so that equal
  strategies have equal rows;
- ``row_keys``: a digest of each row's bytes, to propose no strategy twice.

Everything ``repair`` returns turns into a valid ``Strategy`` by ``StrategyBatch.to_strategy``.
Torch-free; randomness only from the ``numpy.random.Generator`` given.
"""
from __future__ import annotations

import numpy as np

from hybridsync.model.encoding import HIER, PS, RING, ModelArrays, StrategyBatch
from hybridsync.strategy_space import (BY_CLASS, GROUP_COUNT_CHOICES, LARGE_DENSE_BYTES, PARTITION_BYTES_CHOICES,
                                      SpaceBounds)

MUTATIONS = ("route", "partitions", "group", "compression", "protocol", "server", "spread", "class-route",
             "class-compression", "class-group")
ROUTE_CODES = {"ring": RING, "hierarchical": HIER, "bsp": PS}
SSP = 2
MAX_STALENESS = 3
"""SSP staleness drawn by the sampler and the protocol mutation: 1..3 steps."""


def route_codes(bounds: SpaceBounds) -> np.ndarray:
    """The ``StrategyBatch.route`` codes ``bounds`` allows (``SpaceBounds.routes``)."""
    return np.array([ROUTE_CODES[variant] for _, variant in bounds.routes], dtype=np.int8)


def empty_batch(n: int, num_variables: int, num_servers: int) -> StrategyBatch:
    """``n`` plain-Horovod candidates (every variable ring, one message each)."""
    return StrategyBatch(route=np.zeros((n, num_variables), np.int8), protocol=np.zeros((n, num_variables), np.int8),
                         staleness=np.zeros((n, num_variables), np.int64),
                         partitions=np.ones((n, num_variables), np.int64),
                         group=np.full((n, num_variables), -1, np.int64), fp16=np.zeros((n, num_variables), bool),
                         server_share=np.zeros((n, num_variables, max(num_servers, 1))))


def copy_batch(batch: StrategyBatch) -> StrategyBatch:
    """A batch whose arrays the operators may change in place."""
    return batch.take(np.arange(len(batch)))


# --- sampling -----------------------------------------------------------------------------------
def sample(arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator, n: int) -> StrategyBatch:
    """``n`` random candidates, repaired (the distribution of ``space.random_strategy``)."""
    v, codes = arrays.num_variables, route_codes(bounds)
    batch = empty_batch(n, v, bounds.num_servers)
    weights = rng.standard_gamma(0.6, size=(n, len(codes))) + 1e-12  # Dirichlet(0.6, ...)
    cdf = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
    draws = (rng.random((n, v, 1)) > cdf[:, None, :]).sum(axis=2)
    by_class = rng.random(n) < BY_CLASS
    if by_class.any():  # one route per class of variable: sparse, large dense, small dense
        klass = np.where(arrays.sparse, 0, np.where(arrays.nbytes >= LARGE_DENSE_BYTES, 1, 2))
        class_draws = (rng.random((n, 3, 1)) > cdf[:, None, :]).sum(axis=2)
        draws[by_class] = class_draws[by_class][:, klass]
    batch.route[:] = codes[np.minimum(draws, len(codes) - 1)]
    protocol, staleness = _protocols(rng, n)
    batch.protocol[:], batch.staleness[:] = protocol[:, None], staleness[:, None]
    fp16_share = rng.choice([0.0, 0.0, 0.5, 1.0], size=n)
    batch.fp16[:] = rng.random((n, v)) < fp16_share[:, None]
    sizes = np.array([np.inf if b is None else b for b in PARTITION_BYTES_CHOICES])
    partition_bytes = sizes[rng.integers(len(sizes), size=n)]
    parts = np.ceil(arrays.nbytes / partition_bytes[:, None])
    batch.partitions[:] = np.where(arrays.nbytes > partition_bytes[:, None], parts, 1).astype(np.int64)
    batch.partitions[:] = np.clip(batch.partitions, 1, np.minimum(arrays.rows, bounds.max_partitions))
    if bounds.num_servers > 0:
        explicit = (rng.random(n) < 0.3)[:, None] & (batch.route == PS)
        rows, cols = np.nonzero(explicit)
        parts = batch.partitions[rows, cols]
        counts = rng.multinomial(parts, np.full(bounds.num_servers, 1.0 / bounds.num_servers))
        batch.server_share[rows, cols] = counts / parts[:, None]
    num_groups = rng.choice(GROUP_COUNT_CHOICES, size=n)
    batch = repair(batch, arrays, bounds)  # message kinds settle first (sparse all-gather, routes)
    batch.group[:] = _contiguous_groups(batch, num_groups)
    return repair(batch, arrays, bounds)


def _protocols(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Mostly BSP; sometimes ASP, or SSP with a staleness of 1-3 steps (``space._protocol``)."""
    draw = rng.random(n)
    protocol = np.where(draw < 0.7, 0, np.where(draw < 0.85, 1, SSP)).astype(np.int8)
    staleness = np.where(protocol == SSP, rng.integers(1, MAX_STALENESS + 1, size=n), 0)
    return protocol, staleness


def _contiguous_groups(batch: StrategyBatch, num_groups: np.ndarray) -> np.ndarray:
    """Each message kind of each candidate split (backward order) into ``num_groups`` runs
    (``space._with_groups``); 0 groups: none. Variables that must stay alone (sparse
    all-gather) are grouped here and split off again by ``repair``."""
    n, v = batch.route.shape
    kind = _message_kind(batch)
    _, kind = np.unique(kind, return_inverse=True)
    kind = kind.reshape(n, v)
    onehot = kind[:, :, None] == np.arange(kind.max() + 1)
    behind = np.cumsum(onehot[:, ::-1], axis=1)[:, ::-1]  # members of the kind at or after each variable
    position = np.take_along_axis(behind, kind[:, :, None], axis=2)[:, :, 0] - 1
    count = np.take_along_axis(behind[:, 0, :], kind, axis=1)
    run = np.ceil(count / np.maximum(num_groups, 1)[:, None])
    group = kind * (v + 1) + position // run
    return np.where(num_groups[:, None] > 0, group, -1).astype(np.int64)


# --- mutation and crossover ---------------------------------------------------------------------
def mutate(batch: StrategyBatch, arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator,
           max_mutations: int = 2) -> StrategyBatch:
    """1..``max_mutations`` random moves per candidate, in place; the result needs ``repair``."""
    n, v = batch.route.shape
    rounds = rng.integers(1, max_mutations + 1, size=n)
    operators = (_move_route, _split_or_join, _regroup, _toggle_fp16, _change_protocol, _move_shard, _spread,
                 _class_route, _class_fp16, _class_group)
    assert len(operators) == len(MUTATIONS)
    for r in range(max_mutations):
        rows = np.nonzero(rounds > r)[0]
        kinds = rng.integers(len(MUTATIONS), size=len(rows))
        cols = rng.integers(v, size=len(rows))
        for k, operator in enumerate(operators):
            chosen = kinds == k
            if chosen.any():
                operator(batch, rows[chosen], cols[chosen], arrays, bounds, rng)
    return batch


def _move_route(batch, rows, cols, arrays, bounds, rng) -> None:
    codes = route_codes(bounds)
    if len(codes) < 2:
        return
    current = np.argmax(batch.route[rows, cols, None] == codes, axis=1)
    new = codes[(current + rng.integers(1, len(codes), size=len(rows))) % len(codes)]  # another route
    # a variable moved to the PS takes the protocol of the candidate's other PS variables
    first_ps = np.argmax(batch.route[rows] == PS, axis=1)
    batch.protocol[rows, cols] = batch.protocol[rows, first_ps]
    batch.staleness[rows, cols] = batch.staleness[rows, first_ps]
    batch.route[rows, cols] = new
    _whole_group(batch, rows, cols, rng, ("route", "protocol", "staleness"))


def _whole_group(batch, rows, cols, rng, fields) -> None:
    """Half the time, the group of each changed variable follows it (its merged message changes
    route or compression: one member alone would only leave the group)."""
    members = (batch.group[rows] == batch.group[rows, cols][:, None]) & (batch.group[rows, cols] >= 0)[:, None]
    members &= (rng.random(len(rows)) < 0.5)[:, None]
    for name in fields:
        field = getattr(batch, name)
        field[rows] = np.where(members, field[rows, cols][:, None], field[rows])


def _split_or_join(batch, rows, cols, arrays, bounds, rng) -> None:
    parts = batch.partitions[rows, cols]
    most = np.minimum(arrays.rows[cols], bounds.max_partitions)
    finer = (parts == 1) | ((rng.random(len(rows)) < 0.5) & (parts * 2 <= most))
    batch.partitions[rows, cols] = np.where(finer, np.minimum(parts * 2, most), np.maximum(parts // 2, 1))


def _regroup(batch, rows, cols, arrays, bounds, rng) -> None:
    """Leave its group (half the time, when in one) or join another variable's group (a new group of
    the two if it has none) and take its route, protocol and compression; mostly a neighbour
    in ready order: merged messages of gradients ready together save messages without waiting."""
    v = batch.route.shape[1]
    rank = np.empty(v, np.int64)
    rank[arrays.ready_order] = np.arange(v)
    step = np.where(rng.random(len(rows)) < 0.5, -1, 1)
    neighbour = arrays.ready_order[np.clip(rank[cols] + step, 0, v - 1)]
    other = np.where(rng.random(len(rows)) < 0.7, neighbour, rng.integers(v, size=len(rows)))
    fresh = batch.group[rows].max(axis=1) + 1
    target = np.where(batch.group[rows, other] >= 0, batch.group[rows, other], fresh)
    leave = (batch.group[rows, cols] >= 0) & (rng.random(len(rows)) < 0.5)
    join_rows, join_cols, join_other = rows[~leave], cols[~leave], other[~leave]
    batch.group[join_rows, join_other] = target[~leave]
    batch.group[rows, cols] = np.where(leave, -1, target)
    for name in ("route", "protocol", "staleness", "fp16"):  # a member takes the group's message kind
        field = getattr(batch, name)
        field[join_rows, join_cols] = field[join_rows, join_other]


def _toggle_fp16(batch, rows, cols, arrays, bounds, rng) -> None:
    batch.fp16[rows, cols] = ~batch.fp16[rows, cols]
    _whole_group(batch, rows, cols, rng, ("fp16",))


def _spread(batch, rows, cols, arrays, bounds, rng) -> None:
    """The variable's settings (route, protocol, fp16, partitions, group) copied to the variables
    ready around it (a run of about 4 either side), or, a fifth of the time, to every variable:
    the coordinated moves (a whole block fused on one route; a pure strategy) that single
    changes reach only through worse candidates."""
    v = batch.route.shape[1]
    rank = np.empty(v, np.int64)
    rank[arrays.ready_order] = np.arange(v)
    reach = np.where(rng.random(len(rows)) < 0.2, v, rng.geometric(0.25, size=len(rows)))
    inside = np.abs(rank[None, :] - rank[cols][:, None]) <= reach[:, None]
    for name in ("route", "protocol", "staleness", "fp16", "partitions", "group"):
        field = getattr(batch, name)
        field[rows] = np.where(inside, field[rows, cols][:, None], field[rows])


def variable_classes(arrays: ModelArrays) -> np.ndarray:
    """Each variable's class (``strategy_space.CLASSES`` index: 0 sparse, 1 large dense, 2 small dense)."""
    return np.where(arrays.sparse, 0, np.where(arrays.nbytes >= LARGE_DENSE_BYTES, 1, 2))


def _same_class(rows, cols, arrays) -> np.ndarray:
    """(len(rows), variables): whether each variable is of the class of the row's chosen variable."""
    klass = variable_classes(arrays)
    return klass[None, :] == klass[cols][:, None]


def _class_route(batch, rows, cols, arrays, bounds, rng) -> None:
    """Every variable of the chosen variable's class (sparse, large or small dense) moves to one other
    route: how a hand tuner tries "embeddings on the PS" or "large layers hierarchical" at once."""
    codes = route_codes(bounds)
    if len(codes) < 2:
        return
    current = np.argmax(batch.route[rows, cols, None] == codes, axis=1)
    new = codes[(current + rng.integers(1, len(codes), size=len(rows))) % len(codes)]
    first_ps = np.argmax(batch.route[rows] == PS, axis=1)  # the PS variables' protocol, as in _move_route
    members = _same_class(rows, cols, arrays)
    batch.route[rows] = np.where(members, new[:, None], batch.route[rows])
    for name in ("protocol", "staleness"):
        field = getattr(batch, name)
        field[rows] = np.where(members, field[rows, first_ps][:, None], field[rows])


def _class_fp16(batch, rows, cols, arrays, bounds, rng) -> None:
    """fp16 on (or off) for every variable of the chosen variable's class."""
    batch.fp16[rows] = np.where(_same_class(rows, cols, arrays), ~batch.fp16[rows, cols][:, None], batch.fp16[rows])


def _class_group(batch, rows, cols, arrays, bounds, rng) -> None:
    """The chosen variable's class fused into one new merge group, or (if the variable is grouped)
    every member of the class out of its group; repair splits a group by message kind."""
    members = _same_class(rows, cols, arrays)
    fresh = batch.group[rows].max(axis=1) + 1
    target = np.where(batch.group[rows, cols] >= 0, -1, fresh)
    batch.group[rows] = np.where(members, target[:, None], batch.group[rows])


def _change_protocol(batch, rows, cols, arrays, bounds, rng) -> None:
    protocol, staleness = _protocols(rng, len(rows))
    protocol = np.where(protocol == batch.protocol[rows, cols], (protocol + 1) % 3, protocol)  # a real change
    staleness = np.where(protocol == SSP, np.maximum(staleness, 1), 0)
    if bounds.num_servers > 0:  # a candidate without PS variables: this one moves to the PS
        alone = ~(batch.route[rows] == PS).any(axis=1)
        batch.route[rows[alone], cols[alone]] = PS
    on_ps = batch.route[rows] == PS
    batch.protocol[rows] = np.where(on_ps, protocol[:, None], batch.protocol[rows])
    batch.staleness[rows] = np.where(on_ps, staleness[:, None], batch.staleness[rows])


def _move_shard(batch, rows, cols, arrays, bounds, rng) -> None:
    """Balanced -> every shard on one server; explicit -> one shard to another server, or
    (a fifth of the time) back to balanced."""
    if bounds.num_servers == 0:
        return
    on_ps = batch.route[rows] == PS
    cols = np.where(on_ps[np.arange(len(rows)), cols], cols, np.argmax(on_ps * rng.random(on_ps.shape), axis=1))
    keep = on_ps.any(axis=1)
    rows, cols = rows[keep], cols[keep]
    servers = batch.server_share.shape[2]
    parts = batch.partitions[rows, cols]
    counts = np.rint(batch.server_share[rows, cols] * parts[:, None])
    target = rng.integers(bounds.num_servers, size=len(rows))
    balanced = counts.sum(axis=1) == 0
    source = np.argmax((counts > 0) * rng.random((len(rows), servers)), axis=1)
    counts[np.arange(len(rows)), source] -= ~balanced
    counts[np.arange(len(rows)), target] += np.where(balanced, parts, 1)
    back = ~balanced & (rng.random(len(rows)) < 0.2)
    counts[back] = 0
    batch.server_share[rows, cols] = counts / parts[:, None]


def crossover(a: StrategyBatch, b: StrategyBatch, rng: np.random.Generator) -> StrategyBatch:
    """Each variable's settings from ``a`` or ``b`` (even odds); ``b``'s merge groups are
    renumbered past ``a``'s so groups of different parents stay apart. Needs ``repair``."""
    take_a = rng.random(a.route.shape) < 0.5
    offset = a.group.max(axis=1, keepdims=True) + 1
    fields = {name: np.where(take_a, getattr(a, name), getattr(b, name))
              for name in ("route", "protocol", "staleness", "partitions", "fp16")}
    group = np.where(take_a, a.group, np.where(b.group >= 0, b.group + offset, -1))
    share = np.where(take_a[:, :, None], a.server_share, b.server_share)
    return StrategyBatch(group=group, server_share=share, **fields)


# --- repair -------------------------------------------------------------------------------------
def repair(batch: StrategyBatch, arrays: ModelArrays, bounds: SpaceBounds) -> StrategyBatch:
    """The nearest candidates within ``bounds`` (a new batch):

    routes the cluster lacks become ring; partitions within the variable's rows and
    ``max_partitions``; fp16 only for floating variables; protocol and staleness only on the
    PS (SSP staleness >= 0); sparse gradients all-reduced as Horovod's all-gather (ring, one
    message, no group, no fp16) unless ``densify_sparse``; explicit server shares that are
    not whole shards, or name servers that do not exist, become balanced; the server-memory
    bound; ``exact``: no fp16 and BSP only; then merge groups split into one group per message
    kind, groups of one dissolved and groups numbered by their first member.
    """
    route = batch.route.astype(np.int8, copy=True)
    if not bounds.hierarchical:
        route[route == HIER] = RING
    if bounds.num_servers == 0:
        route[route == PS] = RING
    partitions = np.clip(batch.partitions, 1, np.minimum(arrays.rows, bounds.max_partitions))
    fp16 = batch.fp16 & arrays.floating & (not bounds.exact)
    group = batch.group.copy()
    share = _repair_shares(batch.server_share, route, partitions, bounds)
    if bounds.server_memory_bytes is not None:
        _fit_server_memory(route, share, arrays, bounds)
    if not bounds.densify_sparse:
        gather = arrays.sparse & (route != PS)
        route[gather], partitions[gather], fp16[gather], group[gather] = RING, 1, False, -1
    on_ps = route == PS
    protocol = np.where(on_ps & (not bounds.exact), batch.protocol, 0).astype(np.int8)
    staleness = np.where(on_ps & (protocol == SSP), np.maximum(batch.staleness, 0), 0)
    repaired = StrategyBatch(route=route, protocol=protocol, staleness=staleness, partitions=partitions,
                             group=group, fp16=fp16, server_share=share)
    repaired.group[:] = canonical_groups(repaired)
    return repaired


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


def _fit_server_memory(route: np.ndarray, share: np.ndarray, arrays: ModelArrays, bounds: SpaceBounds) -> None:
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


def _message_kind(batch: StrategyBatch) -> np.ndarray:
    """An integer per (candidate, variable): equal exactly when two variables may share a message
    (route, algorithm or protocol, compression, staleness: ``VarConfig.message_key``)."""
    staleness = np.minimum(batch.staleness, 1023)
    return ((batch.route.astype(np.int64) * 3 + batch.protocol) * 2 + batch.fp16) * 1024 + staleness


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
    key = (rows * labels + batch.group[rows, cols]) * (18 * 1024) + _message_kind(batch)[rows, cols]
    unique, first, inverse, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    shared = counts > 1
    order = np.argsort(np.where(shared, first, np.iinfo(np.int64).max), kind="stable")[:shared.sum()]
    group_rows = rows[first[order]]  # non-decreasing: ``first`` follows the row-major nonzero order
    label = np.full(len(unique), -1, np.int64)
    label[order] = np.arange(len(order)) - np.searchsorted(group_rows, group_rows, side="left")
    out[rows, cols] = label[inverse]
    return out


# --- keys ---------------------------------------------------------------------------------------
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def row_keys(batch: StrategyBatch) -> list[bytes]:
    """A 16-byte digest of each candidate's arrays: equal for equal (repaired) candidates.

    The row's bytes (server shares as whole shards) as 64-bit words, each mixed with its
    position by splitmix64's finalizer, then summed plainly and with per-position odd
    weights: vectorized, so keying 10,000 candidates a second costs little (a Python hash
    per row would cost as much as the rest of the search).
    """
    n = len(batch)
    code = (batch.route.astype(np.uint8) | (batch.protocol.astype(np.uint8) << 2)
            | (batch.fp16.astype(np.uint8) << 4))
    shards = np.rint(batch.server_share * batch.partitions[:, :, None]).astype(np.int16).reshape(n, -1)
    packed = np.concatenate([code, *(a.astype(np.int16).view(np.uint8) for a in
                                     (batch.staleness, batch.partitions, batch.group, shards))], axis=1)
    width = -(-packed.shape[1] // 8) * 8
    words = np.zeros((n, width), np.uint8)
    words[:, :packed.shape[1]] = packed
    words = words.view(np.uint64)
    position = np.arange(1, words.shape[1] + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = words ^ (position * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
        z ^= z >> np.uint64(31)
        digest = np.stack([z.sum(axis=1), (z * (position * _MIX[0] | np.uint64(1))).sum(axis=1)], axis=1)
    return digest.view("S16")[:, 0].tolist()
