"""The routing plan: which pieces of which gradients travel together, by which route, in what size.

A plan is derived once, at optimizer construction, from the model's variables and the
strategy. Partitioning splits a variable along dim 0 into near-equal shards; merging
fuses the k-th shards of the variables that share a ``group`` into one message. The
plan is pure data, so every rank can compare fingerprints before the first step, and a
complete one: without torch, Horovod or a cluster it says what the router will send.

- Each message carries its tensors as they travel (``Message.wire``: elements and dtype
  after compression) and their bytes (``wire_bytes``).
- ``RoutingPlan.ps_keys`` gives, for every parameter-server message, its keys (name,
  bytes) and their servers, exactly as the running router and servers place them
  (``hybridsync.placement``, the module the PS client uses).
- A message fed by a sparse variable (``Message.sparse``, from ``VariableInfo.sparse``, or a
  dense one the strategy sends as its nonzero rows: ``VarConfig.rows``)
  sends fewer bytes than ``wire_bytes`` when it goes sparse: on the parameter servers
  only the touched rows (values at the variable's dtype, uncompressed, plus an int64 index
  per row), and a whole sparse variable on the ring route as Horovod's all-gather of
  touched rows; which rows a step touches only the data knows, so ``wire_bytes`` stays
  the dense size (what all-reduce routes send for a sparse piece of a merged or
  partitioned message, or on the hierarchical route).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Mapping, Sequence

from hybridsync import knobs
from hybridsync.description import FLOATING_DTYPES, VariableInfo, itemsize
from hybridsync.placement import DEFAULT_PARTITION_BYTES, KeyTable, WireTensor, namespaced, part_key
from hybridsync.strategy import Strategy, VarConfig


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
    numel: int
    """Elements of the piece."""
    dtype: str
    """The variable's element type (before compression)."""
    sparse: bool = False
    """The piece travels as touched rows: the variable's gradient is sparse (``VariableInfo.sparse``), or
    dense and sent as its nonzero rows (``rows``)."""
    rows: bool = False
    """The strategy sends this dense gradient as its nonzero rows (``VarConfig.rows``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    """One synchronization call: the pieces it carries and how they travel."""

    name: str
    """Identical on every rank; an unsplit, unmerged variable keeps its own name (as in Horovod)."""
    config: VarConfig
    pieces: tuple[Piece, ...]
    wire: tuple[WireTensor, ...]
    """Each piece as it travels: its elements, in the dtype after compression."""

    @property
    def var_indices(self) -> frozenset[int]:
        return frozenset(piece.var_index for piece in self.pieces)

    @property
    def wire_bytes(self) -> int:
        """Bytes of the message on the wire, per worker and direction (dense size: see ``sparse``)."""
        return sum(t.nbytes for t in self.wire)

    @property
    def sparse(self) -> bool:
        """A sparse variable feeds it: the bytes sent depend on the rows a step touches (module docstring)."""
        return any(piece.sparse for piece in self.pieces)

    @property
    def exchanges_parameters(self) -> bool:
        """ASP/SSP: no gradient is exchanged; the parameters are pushed and pulled after the local step."""
        return self.config.route == "ps" and self.config.protocol in ("asp", "ssp")

    @property
    def server(self) -> int | None:
        """The parameter server the strategy names for this message's shard (``None``: balanced by bytes)."""
        servers = self.config.servers
        return servers[self.pieces[0].shard] if servers else None

    def parameter_keys(self) -> tuple[tuple[str, Piece], ...]:
        """ASP/SSP: the key of each piece's parameter rows on the servers (the message name if alone)."""
        return tuple((part_key(self.name, piece.var_name, len(self.pieces)), piece) for piece in self.pieces)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PSKey:
    """One parameter-server key: its name on the servers, its bytes and the server holding it."""

    name: str
    nbytes: int
    """Bytes per push (and per pull); for a ``sparse`` key the dense bound (see ``sparse``)."""
    server: int
    sparse: bool = False
    """Touched rows only: ``nbytes`` (all rows, the variable's dtype: sparse rows are never
    compressed) plus an int64 index per row is the most it carries; a step sends the rows it touched."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingPlan:
    """All messages of a step, in a deterministic order, and which messages each variable feeds."""

    var_names: tuple[str, ...]
    messages: tuple[Message, ...]
    messages_of_var: tuple[tuple[int, ...], ...]
    """For variable i, the indices of the messages its gradient is part of."""

    def fingerprint(self) -> str:
        """Hash of every message's name, route settings and pieces (with their sizes and element types):
        equal plans hash equally, and ranks whose models differ only in a width (a variable with as many
        rows but other columns) do not, since the hierarchical route would sum their gradients silently."""
        doc = [[m.name, m.config.to_dict(), [[p.var_name, p.start, p.stop, p.numel, p.dtype,
                                               *(["rows"] if p.rows else [])] for p in m.pieces]]
               for m in self.messages]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]

    def parameter_syncs(self) -> list[tuple[int | None, list[tuple[str, Piece, int | None]]]]:
        """ASP/SSP pieces as the router hands them to the servers: per staleness (``None``: ASP), in
        plan order, ``(key name, piece, server or None)``."""
        by_staleness: dict[int | None, list[tuple[str, Piece, int | None]]] = {}
        for message in self.messages:
            if message.exchanges_parameters:
                by_staleness.setdefault(message.config.staleness, []).extend(
                    (key, piece, message.server) for key, piece in message.parameter_keys())
        return list(by_staleness.items())

    def ps_keys(self, *, num_servers: int, partition_bytes: int = DEFAULT_PARTITION_BYTES, namespace: str = "",
                loads: Sequence[int] | None = None) -> dict[str, tuple[PSKey, ...]]:
        """Every parameter-server message's keys and their servers, as a router running this plan places them.

        ``namespace`` is the router's (``Router.namespace``); ``loads`` the bytes already on
        each server from earlier routers of the job (none: a fresh job). The router declares
        the BSP messages at construction (plan order, balanced together), then, at the first
        step, the ASP/SSP parameters (per staleness, in plan order). A ``sparse`` message
        travels as parts on the server of its first declared key (their bytes count as its
        own): a whole sparse variable as one key under the message's name; a shard or a merge
        group holding one, each piece under ``<message>.<variable>`` (a lone piece: the
        message's name), sparse pieces as touched rows, dense ones as keys of their own.
        """
        table = KeyTable(num_servers, partition_bytes, loads)
        bsp = [m for m in self.messages if m.config.route == "ps" and not m.exchanges_parameters]
        table.declare_all([(namespaced(namespace, m.name), m.wire, m.server) for m in bsp])
        for _, pieces in self.parameter_syncs():
            table.declare_all([(namespaced(namespace, key), (_parameter_wire(piece),), server)
                               for key, piece, server in pieces])
        out = {m.name: tuple(_sparse_keys(table, namespaced(namespace, m.name), m) if m.sparse
                             else _keys(table, namespaced(namespace, m.name), m.wire)) for m in bsp}
        for message in (m for m in self.messages if m.exchanges_parameters):
            out[message.name] = tuple(key for name, piece in message.parameter_keys()
                                      for key in _keys(table, namespaced(namespace, name), (_parameter_wire(piece),)))
        return out


def _keys(table: KeyTable, name: str, wire: Sequence[WireTensor]) -> list[PSKey]:
    """The placed keys of message ``name``."""
    return [PSKey(name=c.key, nbytes=c.nbytes, server=table.server_of(c.key)) for c in table.layout(name, wire).chunks]


def _sparse_keys(table: KeyTable, home: str, message: Message) -> list[PSKey]:
    """A BSP message holding a sparse variable, as ``PSBackend.submit_sparse``/``submit_parts`` send it."""
    pieces = message.pieces
    out = []
    for piece, wire in zip(pieces, message.wire):
        key = part_key(home, piece.var_name, len(pieces))
        if piece.sparse:
            table.follow(home, key)
            out.append(PSKey(name=key, nbytes=_parameter_wire(piece).nbytes, server=table.server_of(key), sparse=True))
        else:
            table.follow(home, key, (wire,))
            out += _keys(table, key, (wire,))
    return out


def shard_bounds(rows: int, partitions: int) -> list[tuple[int, int]]:
    """Near-equal row ranges, the first ``rows % partitions`` shards one row longer (as ``torch.tensor_split``)."""
    if not 1 <= partitions <= max(rows, 1):
        raise ValueError(f"partitions must be in 1..{max(rows, 1)} for {rows} rows, got {partitions}")
    base, extra = divmod(rows, partitions)
    bounds, start = [], 0
    for k in range(partitions):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def build_plan(variables: Mapping[str, VariableInfo], strategy: Strategy | None, *,
               compression: str = "none") -> RoutingPlan:
    """Partition and merge the variables (in the given order) as ``strategy`` says.

    ``compression`` is what a message whose config names none is sent with (the
    optimizer's ``compression=``): it sets the wire dtypes, nothing else.
    """
    if compression not in knobs.COMPRESSION.choices:
        raise ValueError(f"compression {compression!r} is not one of {', '.join(knobs.COMPRESSION.choices)}")
    strategy = strategy or Strategy()
    strategy.validate_for(variables)
    buckets: dict[tuple, list[Piece]] = {}
    configs: dict[tuple, VarConfig] = {}
    for index, (name, info) in enumerate(variables.items()):
        config = strategy.config_for(name)
        rows = info.shape[0] if info.shape else 1
        row_numel = math.prod(info.shape[1:])
        for shard, (start, stop) in enumerate(shard_bounds(rows, config.partitions)):
            piece = Piece(var_index=index, var_name=name, shard=shard, start=start, stop=stop,
                          whole=config.partitions == 1, numel=(stop - start) * row_numel,
                          dtype=info.dtype, sparse=info.sparse or config.rows, rows=config.rows)
            key = ("group", config.group, shard) if config.group is not None else ("var", name, shard)
            buckets.setdefault(key, []).append(piece)
            configs.setdefault(key, config)
    messages = tuple(Message(name=_message_name(key, configs[key], pieces), config=configs[key],
                             pieces=tuple(pieces), wire=_wire(pieces, configs[key].compression or compression))
                     for key, pieces in buckets.items())
    messages_of_var: list[list[int]] = [[] for _ in variables]
    for m_index, message in enumerate(messages):
        for var_index in sorted(message.var_indices):
            messages_of_var[var_index].append(m_index)
    return RoutingPlan(var_names=tuple(variables), messages=messages,
                       messages_of_var=tuple(tuple(m) for m in messages_of_var))


def wire_dtype(dtype: str, compression: str) -> str:
    """A dtype on the wire: ``fp16`` sends every floating dtype as float16 (``compression.FP16Compressor``)."""
    return "float16" if compression == "fp16" and dtype in FLOATING_DTYPES else dtype


def _wire(pieces: Sequence[Piece], compression: str) -> tuple[WireTensor, ...]:
    out = []
    for piece in pieces:
        dtype = wire_dtype(piece.dtype, compression)
        out.append(WireTensor(numel=piece.numel, dtype=dtype, itemsize=itemsize(dtype)))
    return tuple(out)


def _parameter_wire(piece: Piece) -> WireTensor:
    """An ASP/SSP piece on the wire: parameter rows (deltas and values), never compressed."""
    return _wire((piece,), "none")[0]


def _message_name(key: tuple, config: VarConfig, pieces: list[Piece]) -> str:
    kind, ident, shard = key
    if kind == "group":
        return f"hybridsync.group{ident}.shard{shard}"
    if config.partitions == 1:
        return str(ident)
    return f"{ident}.shard{shard}of{config.partitions}"
