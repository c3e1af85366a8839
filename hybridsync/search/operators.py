"""The search's operators on ``StrategyBatch`` arrays: mutate, crossover, keys.

A search that scores 10,000 candidates a second cannot build ``Strategy`` objects for them,
so every operator here works on whole batches (candidates x variables) with numpy:

- ``mutate``: the moves of a person tuning by hand, one per knob the search moves (``MUTATIONS``:
  route/algorithm, partitions x2 or /2, regroup, a merged message cut in two or joined with the
  next (its stages), fp16, the PS protocol of every PS variable, a shard to another server, a
  dense embedding's rows on or off), ``spread`` (a variable's settings copied to its neighbours),
  and the same for a whole class of variable at once (sparse, large dense, small dense: another
  route, fp16 on or off, fused or split);
- ``crossover``: each variable's settings from one parent or the other;
- ``row_keys``: a digest of each row's bytes, to propose no strategy twice.

The sampler and the repair, which trials share, are the strategy space's
(``hybridsync.strategy_space``): what these operators make needs ``repair`` before it is a
candidate. Torch-free; randomness only from the ``numpy.random.Generator`` given.
"""
from __future__ import annotations

import numpy as np

from hybridsync import knobs
from hybridsync.model.encoding import ModelArrays
from hybridsync.strategy_space import PS, RING, SpaceBounds, StrategyBatch, variable_classes
from hybridsync.strategy_space.batch import SSP
from hybridsync.strategy_space.sample import draw_protocols


def route_codes(bounds: SpaceBounds) -> np.ndarray:
    """The ``StrategyBatch.route`` codes ``bounds`` allows (``SpaceBounds.routes``)."""
    return np.array(bounds.routes, dtype=np.int8)


# --- mutation and crossover ---------------------------------------------------------------------
def mutate(batch: StrategyBatch, arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator,
           max_mutations: int = 2) -> StrategyBatch:
    """1..``max_mutations`` random moves per candidate, in place; the result needs ``repair``."""
    n, v = batch.route.shape
    rounds = rng.integers(1, max_mutations + 1, size=n)
    for r in range(max_mutations):
        rows = np.nonzero(rounds > r)[0]
        kinds = rng.integers(len(MUTATIONS), size=len(rows))
        cols = rng.integers(v, size=len(rows))
        for k, operator in enumerate(MUTATIONS.values()):
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
    _copy_settings(batch, rows, cols, members, fields)


def _copy_settings(batch, rows, cols, where, fields) -> None:
    """In each row, the settings ``fields`` of its column ``cols`` copied to the columns ``where`` marks."""
    for name in fields:
        field = getattr(batch, name)
        field[rows] = np.where(where, field[rows, cols][:, None], field[rows])


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


def _cut_or_join(batch, rows, cols, arrays, bounds, rng) -> None:
    """A merged message cut in two at one of its members in ready order (it and the members ready
    after it become a message of their own), or, half the time, joined with the merged message
    ready next: the stages of a fused buffer (PyTorch DDP's buckets), each sent while the backward
    pass computes the next, whose boundaries ``_regroup`` moves only one variable at a time (two
    of these moves shift one by any distance). The chosen variable, if in no group, gives way
    to a grouped one of the candidate's."""
    v = batch.route.shape[1]
    rank = np.empty(v, np.int64)
    rank[arrays.ready_order] = np.arange(v)
    group = batch.group[rows]
    grouped = group >= 0
    cols = np.where(grouped[np.arange(len(rows)), cols], cols, np.argmax(grouped * rng.random(group.shape), axis=1))
    own = group[np.arange(len(rows)), cols]
    members = (group == own[:, None]) & (own >= 0)[:, None]
    cut = rng.random(len(rows)) < 0.5
    moved = members & (rank[None, :] >= rank[cols][:, None]) & cut[:, None]
    last = np.where(members, rank[None, :], -1).max(axis=1)
    later = (rank[None, :] > last[:, None]) & grouped & ~members
    next_group = group[np.arange(len(rows)), np.where(later, rank[None, :], v).argmin(axis=1)]
    joined = (group == next_group[:, None]) & (~cut & later.any(axis=1) & (own >= 0))[:, None]
    group = np.where(moved, (group.max(axis=1) + 1)[:, None], group)
    batch.group[rows] = np.where(joined, own[:, None], group)
    _copy_settings(batch, rows, cols, joined, ("route", "protocol", "staleness", "fp16"))  # one message kind


def _toggle_fp16(batch, rows, cols, arrays, bounds, rng) -> None:
    batch.fp16[rows, cols] = ~batch.fp16[rows, cols]
    _whole_group(batch, rows, cols, rng, ("fp16",))


def _toggle_rows(batch, rows, cols, arrays, bounds, rng) -> None:
    """One of the variables where rows may pay (``ModelArrays.embedding_like``; none: no move) to or
    from sending its nonzero rows: turned on, it leaves its group and fp16, and off the PS it goes
    alone on the ring (Horovod's sparse all-gather), so that repair keeps it."""
    where = np.nonzero(arrays.embedding_like)[0]
    if len(where) == 0:
        return
    cols = where[rng.integers(len(where), size=len(rows))]
    on = ~batch.rows[rows, cols]
    batch.rows[rows, cols] = on
    rows, cols = rows[on], cols[on]
    batch.fp16[rows, cols] = False
    batch.group[rows, cols] = -1
    off_ps = batch.route[rows, cols] != PS
    batch.route[rows[off_ps], cols[off_ps]] = RING
    batch.partitions[rows[off_ps], cols[off_ps]] = 1


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
    _copy_settings(batch, rows, cols, inside, ("route", "protocol", "staleness", "fp16", "partitions", "group"))


def _change_protocol(batch, rows, cols, arrays, bounds, rng) -> None:
    protocol, staleness = draw_protocols(rng, len(rows))
    choices = len(knobs.PROTOCOL.choices)
    protocol = np.where(protocol == batch.protocol[rows, cols], (protocol + 1) % choices, protocol)  # a real change
    staleness = np.where(protocol == SSP, np.maximum(staleness, min(knobs.STALENESS.draw)), 0)
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
    _copy_settings(batch, rows, first_ps, members, ("protocol", "staleness"))


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


MUTATIONS = {"route": _move_route, "partitions": _split_or_join, "group": _regroup, "compression": _toggle_fp16,
             "protocol": _change_protocol, "servers": _move_shard, "spread": _spread,
             "class-route": _class_route, "class-compression": _class_fp16, "class-group": _class_group,
             "rows": _toggle_rows, "stages": _cut_or_join}
"""The moves ``mutate`` picks from (evenly): one per knob the search moves (the algorithm moves with
the route, the staleness with the protocol), ``spread``, and the class-wide moves. ``rows`` moves only
where a profile shows it may pay (``ModelArrays.embedding_like``, the rule of the seeds and the rivals'
rows twins); repair clears it where it cannot hold."""
assert set(MUTATIONS) >= {knob.name for knob in knobs.KNOBS} - {"algorithm", "staleness"}


def crossover(a: StrategyBatch, b: StrategyBatch, rng: np.random.Generator) -> StrategyBatch:
    """Each variable's settings from ``a`` or ``b`` (even odds); ``b``'s merge groups are
    renumbered past ``a``'s so groups of different parents stay apart. Needs ``repair``."""
    take_a = rng.random(a.route.shape) < 0.5
    offset = a.group.max(axis=1, keepdims=True) + 1
    fields = {name: np.where(take_a, getattr(a, name), getattr(b, name))
              for name in ("route", "protocol", "staleness", "partitions", "fp16", "rows")}
    group = np.where(take_a, a.group, np.where(b.group >= 0, b.group + offset, -1))
    share = np.where(take_a[:, :, None], a.server_share, b.server_share)
    return StrategyBatch(group=group, server_share=share, **fields)



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
            | (batch.fp16.astype(np.uint8) << 4) | (batch.rows.astype(np.uint8) << 5))
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
