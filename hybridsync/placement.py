"""Parameter-server keys and their servers: how messages are cut and placed, without torch.

One module decides this for everyone who needs it: the PS client at run time, the routing
plan's prediction (``RoutingPlan.ps_keys``, read by the simulator), and the baseline
builders' greedy server choice. A message (one or several tensors) becomes one flat
buffer per dtype, cut into chunks of at most ``partition_bytes``; each chunk is a key.
Keys declared up front are placed greedily, largest first, on the least-loaded server
(by bytes); the order does not depend on when gradients become ready, so every worker
(and a simulator) computes the same placement. A key never declared falls back to a
stable hash of its name.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Iterable, Mapping, Sequence

DEFAULT_PARTITION_BYTES = 4_096_000
"""BytePS's default ``BYTEPS_PARTITION_BYTES``: the largest key, in bytes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireTensor:
    """One tensor of a message as it travels: element count and element type (after compression)."""

    numel: int
    dtype: str
    """As torch spells it without prefix (``float32``, ``float16``...)."""
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunk:
    """Elements ``[start, stop)`` of one dtype group's flat buffer: one key on one server."""

    key: str
    group: int
    """Index into the message's dtype groups."""
    start: int
    stop: int
    nbytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How a message's tensors map onto flat per-dtype buffers and keys."""

    groups: list[list[int]]
    """Indices of the message's tensors, grouped by dtype (groups in order of first appearance)."""
    wire: tuple[WireTensor, ...]
    chunks: list[Chunk]


def dtype_groups(dtypes: Sequence[str]) -> list[list[int]]:
    """Indices of ``dtypes`` grouped by value, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    return list(groups.values())


def chunk_message(name: str, group_sizes: Sequence[tuple[int, int]], partition_bytes: int) -> list[Chunk]:
    """Cut each ``(numel, itemsize)`` group of message ``name`` into keys of <= ``partition_bytes``.

    The key of an uncut single-group message is its name, so simple cases read naturally
    in counters and error messages.
    """
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
    chunks: list[Chunk] = []
    for group, (numel, itemsize) in enumerate(group_sizes):
        per_chunk = max(1, partition_bytes // itemsize)
        for index, start in enumerate(range(0, max(numel, 1), per_chunk)):
            stop = min(start + per_chunk, numel)
            chunks.append(Chunk(key=f"{name}@{group}.{index}", group=group, start=start, stop=stop,
                                nbytes=(stop - start) * itemsize))
    if len(chunks) == 1:
        chunks[0] = dataclasses.replace(chunks[0], key=name)
    return chunks


def message_layout(name: str, wire: Sequence[WireTensor], partition_bytes: int) -> Layout:
    """The dtype groups and keys of message ``name`` made of ``wire`` tensors (see ``chunk_message``)."""
    groups = dtype_groups([t.dtype for t in wire])
    sizes = [(sum(wire[i].numel for i in group), wire[group[0]].itemsize) for group in groups]
    return Layout(groups=groups, wire=tuple(wire), chunks=chunk_message(name, sizes, partition_bytes))


class LeastLoaded:
    """Greedy placement by bytes: each item goes to the least-loaded server (ties: lowest index)."""

    def __init__(self, num_servers: int, loads: Iterable[int] | None = None) -> None:
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"num_servers must be an integer >= 1, got {num_servers!r}")
        self.loads = list(loads) if loads is not None else [0] * num_servers
        if len(self.loads) != num_servers:
            raise ValueError(f"loads has {len(self.loads)} entries for {num_servers} servers")

    def take(self, nbytes: int) -> int:
        """The server for an item of ``nbytes`` (its load grows by them)."""
        server = min(range(len(self.loads)), key=lambda s: (self.loads[s], s))
        self.loads[server] += nbytes
        return server

    def place(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """Server of every key of ``sizes`` (bytes by key name), largest key first; the result
        depends on the mapping's contents, not on its order."""
        return {key: self.take(nbytes) for key, nbytes in sorted(sizes.items(), key=lambda item: (-item[1], item[0]))}


def place_keys(sizes: Mapping[str, int], num_servers: int, loads: Sequence[int] | None = None) -> dict[str, int]:
    """Server of every key: largest key first onto the least-loaded server (ties: lowest index).

    ``loads`` are bytes already on each server (keys placed earlier or explicitly); the
    result does not depend on the mapping's order, only on its contents.
    """
    return LeastLoaded(num_servers, loads).place(sizes)


def namespaced(namespace: str, name: str) -> str:
    """A message's or parameter's key name on the servers: ``<namespace>/<name>`` (one router's keys)."""
    return f"{namespace}/{name}" if namespace else name


def part_key(message: str, part: str, parts: int) -> str:
    """The key of one of ``parts`` parts of a message sent part by part (sparse shards, merge-group
    members, ASP/SSP pieces): ``<message>.<part>``, or the message's own key for a lone part."""
    return message if parts == 1 else f"{message}.{part}"


def hashed_server(key: str, num_servers: int) -> int:
    """Fallback placement for an undeclared key: stable across processes (unlike ``hash``)."""
    return zlib.crc32(key.encode()) % num_servers


Declaration = tuple[str, Sequence[WireTensor], "int | None"]
"""``(message name, its wire tensors, server or None)``: one message declared to the servers."""


class KeyTable:
    """Every key one worker knows and its server: the same on every worker that declared the same messages."""

    def __init__(self, num_servers: int, partition_bytes: int = DEFAULT_PARTITION_BYTES,
                 loads: Sequence[int] | None = None) -> None:
        if partition_bytes < 1:
            raise ValueError(f"partition_bytes must be >= 1, got {partition_bytes}")
        self.num_servers = num_servers
        self.partition_bytes = partition_bytes
        self._balancer = LeastLoaded(num_servers, loads)
        self._placement: dict[str, int] = {}
        self._layouts: dict[str, Layout] = {}
        self._load_of: dict[str, int] = {}
        """Bytes each declared key adds to its server's load (taken off again by ``release``)."""

    @property
    def loads(self) -> list[int]:
        """Bytes of the declared keys on each server (a copy)."""
        return list(self._balancer.loads)

    @property
    def placement(self) -> dict[str, int]:
        """Server of every key placed so far (a copy)."""
        return dict(self._placement)

    def layout(self, name: str, wire: Sequence[WireTensor]) -> Layout:
        """The keys of message ``name`` (fixed at its first use: a later change of sizes is an error)."""
        layout = self._layouts.get(name)
        if layout is None:
            layout = self._layouts[name] = message_layout(name, wire, self.partition_bytes)
        elif [t.numel for t in layout.wire] != [t.numel for t in wire]:
            raise ValueError(f"message {name!r} changed shape: tensors of {tuple(t.numel for t in layout.wire)} "
                             f"elements before, {tuple(t.numel for t in wire)} now")
        return layout

    def declare_all(self, messages: Sequence[Declaration]) -> None:
        """Place the keys of ``(name, wire, server)`` messages: on ``server`` where given, the rest
        balanced by bytes over all of them at once (largest first, least-loaded server).

        Every worker must declare the same messages in the same order (the routing plan's).
        """
        fresh: dict[str, int] = {}
        for name, wire, server in messages:
            if server is not None and not 0 <= server < self.num_servers:
                raise ValueError(f"message {name!r}: server {server} does not exist: the job has "
                                 f"{self.num_servers} parameter server(s), numbered from 0 (DMLC_NUM_SERVER)")
            for chunk in self.layout(name, wire).chunks:
                if chunk.key in self._placement:
                    continue
                if server is None:
                    fresh[chunk.key] = chunk.nbytes
                else:
                    self._placement[chunk.key] = server
                    self._balancer.loads[server] += chunk.nbytes
                    self._load_of[chunk.key] = chunk.nbytes
        for key, server in self._balancer.place(fresh).items():
            self._placement[key] = server
            self._load_of[key] = fresh[key]

    def release(self, prefix: str) -> None:
        """Forget every key and message whose name starts with ``prefix`` (a replaced plan's
        namespace), taking their bytes off their servers' loads."""
        for key in [k for k in self._placement if k.startswith(prefix)]:
            server = self._placement.pop(key)
            self._balancer.loads[server] -= self._load_of.pop(key, 0)
        for name in [n for n in self._layouts if n.startswith(prefix)]:
            del self._layouts[name]

    def follow(self, home: str, name: str, wire: Sequence[WireTensor] | None = None) -> None:
        """Put message ``name``'s keys (``wire`` None: the single key ``name``) on the server of
        declared message ``home``'s first key, where not placed yet.

        Their bytes do not count towards the loads: they stand in for ``home``'s, already counted
        (a sparse gradient's touched rows, a merge group's members sent as their own keys).
        Without ``home`` declared they fall back to the hash placement.
        """
        server = self.server_of_message(home)
        keys = [name] if wire is None else [chunk.key for chunk in self.layout(name, wire).chunks]
        for key in keys:
            if key not in self._placement and server is not None:
                self._placement[key] = server

    def server_of_message(self, message: str) -> int | None:
        """The server of declared ``message``'s first key (``None`` when it was never declared)."""
        layout = self._layouts.get(message)
        return self._placement.get(layout.chunks[0].key) if layout is not None else None

    def server_of(self, key: str) -> int:
        """The server holding ``key``: declared placement, else the hash fallback."""
        if key not in self._placement:
            self._placement[key] = hashed_server(key, self.num_servers)
        return self._placement[key]
