"""The routing plan: which pieces of which gradients travel together, and by which route.

A plan is derived once, at optimizer construction, from the model's variables and the
strategy. Partitioning splits a variable along dim 0 into near-equal shards; merging
fuses the k-th shards of the variables that share a ``group`` into one message. The
plan is pure data, so every rank can compare fingerprints before the first step.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping

from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo


@dataclasses.dataclass(frozen=True, kw_only=True)
class Piece:
    """Rows ``[start, stop)`` along dim 0 of one variable's gradient (the whole of it for scalars)."""

    var_index: int
    var_name: str
    shard: int
    start: int
    stop: int
    whole: bool
    """True when the piece is the entire gradient (no narrowing needed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """One synchronization call: the pieces it carries and how they travel."""

    name: str
    """Identical on every rank; an unsplit, unmerged variable keeps its own name (as in Horovod)."""
    config: VarConfig
    pieces: tuple[Piece, ...]

    @property
    def var_indices(self) -> frozenset[int]:
        return frozenset(piece.var_index for piece in self.pieces)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingPlan:
    """All messages of a step, in a deterministic order, and which messages each variable feeds."""

    var_names: tuple[str, ...]
    messages: tuple[Message, ...]
    messages_of_var: tuple[tuple[int, ...], ...]
    """For variable i, the indices of the messages its gradient is part of."""

    def fingerprint(self) -> str:
        """Hash of every message's name, route settings and pieces: equal plans hash equally."""
        doc = [[m.name, m.config.to_dict(), [[p.var_name, p.start, p.stop] for p in m.pieces]]
               for m in self.messages]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]


def shard_bounds(rows: int, partitions: int) -> list[tuple[int, int]]:
    """Near-equal row ranges, the first ``rows % partitions`` shards one row longer (as ``torch.tensor_split``)."""
    assert 1 <= partitions <= max(rows, 1), (rows, partitions)
    base, extra = divmod(rows, partitions)
    bounds, start = [], 0
    for k in range(partitions):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def build_plan(variables: Mapping[str, VariableInfo], strategy: Strategy | None) -> RoutingPlan:
    """Partition and merge the variables (in the given order) as ``strategy`` says."""
    strategy = strategy or Strategy()
    strategy.validate_for(variables)
    buckets: dict[tuple, list[Piece]] = {}
    configs: dict[tuple, VarConfig] = {}
    for index, (name, info) in enumerate(variables.items()):
        config = strategy.config_for(name)
        rows = info.shape[0] if info.shape else 1
        for shard, (start, stop) in enumerate(shard_bounds(rows, config.partitions)):
            piece = Piece(var_index=index, var_name=name, shard=shard, start=start, stop=stop,
                          whole=config.partitions == 1)
            key = ("group", config.group, shard) if config.group is not None else ("var", name, shard)
            buckets.setdefault(key, []).append(piece)
            configs.setdefault(key, config)
    messages = tuple(Message(name=_message_name(key, configs[key], pieces), config=configs[key],
                             pieces=tuple(pieces)) for key, pieces in buckets.items())
    messages_of_var: list[list[int]] = [[] for _ in variables]
    for m_index, message in enumerate(messages):
        for var_index in sorted(message.var_indices):
            messages_of_var[var_index].append(m_index)
    return RoutingPlan(var_names=tuple(variables), messages=messages,
                       messages_of_var=tuple(tuple(m) for m in messages_of_var))


def _message_name(key: tuple, config: VarConfig, pieces: list[Piece]) -> str:
    kind, ident, shard = key
    if kind == "group":
        return f"hybridsync.group{ident}.shard{shard}"
    if config.partitions == 1:
        return str(ident)
    return f"{ident}.shard{shard}of{config.partitions}"
