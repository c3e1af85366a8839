"""Keys and their placement on servers: pure functions, identical on every worker.

A message (one or several tensors) becomes one flat buffer per dtype, cut into chunks of
at most ``partition_bytes``; each chunk is a key. Keys declared up front are placed
greedily, largest first, on the least-loaded server (by bytes); the order does not depend
on when gradients become ready, so every worker computes the same placement. A key that
was never declared falls back to a stable hash of its name.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Mapping, Sequence

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunk:
    """Elements ``[start, stop)`` of one dtype group's flat buffer: one key on one server."""

    key: str
    group: int
    """Index into the message's dtype groups."""
    start: int
    stop: int
    nbytes: int


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
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


def message_chunks(name: str, tensors: Sequence[torch.Tensor], partition_bytes: int) -> list[Chunk]:
    """The keys of a message made of ``tensors`` (see ``chunk_message``)."""
    sizes = [(sum(tensors[i].numel() for i in group), tensors[group[0]].element_size())
             for group in dtype_groups(tensors)]
    return chunk_message(name, sizes, partition_bytes)


def place_keys(sizes: Mapping[str, int], num_servers: int, loads: Sequence[int] | None = None) -> dict[str, int]:
    """Server of every key: largest key first onto the least-loaded server (ties: lowest index).

    ``loads`` are bytes already on each server (keys placed earlier or explicitly); the
    result does not depend on the mapping's order, only on its contents.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    current = list(loads) if loads is not None else [0] * num_servers
    assert len(current) == num_servers, (current, num_servers)
    placement: dict[str, int] = {}
    for key, nbytes in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        server = min(range(num_servers), key=lambda s: (current[s], s))
        placement[key] = server
        current[server] += nbytes
    return placement


def hashed_server(key: str, num_servers: int) -> int:
    """Fallback placement for an undeclared key: stable across processes (unlike ``hash``)."""
    return zlib.crc32(key.encode()) % num_servers
