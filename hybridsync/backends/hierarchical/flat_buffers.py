"""A message's tensors as one flat buffer: padding, per-rank slices, and copies of element ranges.

Hierarchical all-reduce moves a message as one flat buffer whose length is a multiple of
the node size, so that every rank of a node carries an equal slice of it. The copies work
on ranges of that buffer's positions, so a rank can copy only the part of a message that
another rank needs, or only the part that is final already.
"""
from __future__ import annotations

import functools
import sys
from typing import Iterator, Sequence

import torch

Ranges = Sequence[tuple[int, int]]
EVERYTHING: Ranges = ((0, sys.maxsize),)


def buffer_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of a message's buffer: its tensors' common dtype (``torch.promote_types``).

    A merge group may mix dtypes (a model partly in float64, or in half precision): each
    tensor is summed at a precision at least its own and copied back in its own dtype, so
    the result is at least as exact as a ring all-reduce of each alone, at the wider dtype's bytes.
    """
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def flatten_padded(tensors: Sequence[torch.Tensor], multiple: int) -> tuple[torch.Tensor, int]:
    """A fresh flat copy of ``tensors`` (in ``buffer_dtype``) zero-padded to a multiple of ``multiple``,
    and the unpadded length.

    Fresh, so the collectives may work on it in place without touching the caller's tensors.
    """
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(buffer_dtype(tensors))
    numel = flat.numel()
    pad = (-numel) % multiple
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat, numel


def padded_length(tensors: Sequence[torch.Tensor], multiple: int) -> int:
    """The length of ``flatten_padded(tensors, multiple)``'s buffer, without building it."""
    numel = sum(t.numel() for t in tensors)
    return numel + (-numel) % multiple


def node_slice(node_sum: torch.Tensor, local_size: int, local_rank: int) -> torch.Tensor:
    """The contiguous ``1/local_size`` of the node's sum that this rank carries across nodes (a view)."""
    assert node_sum.numel() % local_size == 0, (node_sum.numel(), local_size)
    start, stop = slice_range(node_sum.numel(), local_size, local_rank)
    return node_sum[start:stop]


def slice_range(padded: int, local_size: int, local_rank: int) -> tuple[int, int]:
    """The positions of ``node_slice``'s slice in the flat buffer."""
    length = padded // local_size
    return local_rank * length, (local_rank + 1) * length


def pieces(tensors: Sequence[torch.Tensor], ranges: Ranges) -> Iterator[tuple[torch.Tensor, int, int]]:
    """``(part of a tensor, start, stop)`` for every overlap of a tensor's flat positions with
    ``ranges``; the part has the tensor's shape where the overlap is the whole tensor, else it
    is a 1-d view (which needs a contiguous tensor)."""
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        for lo, hi in ranges:
            start, stop = max(lo, offset), min(hi, offset + n)
            if start < stop:
                yield (tensor if stop - start == n else tensor.view(-1)[start - offset:stop - offset]), start, stop
        offset += n


def _flat_part(flat: torch.Tensor, part: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return flat[start:stop].view(part.shape)


def copy_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, factor: float, ranges: Ranges = EVERYTHING) -> None:
    """Writes ``tensors``, laid one after another from the front of ``flat`` and multiplied by
    ``factor``, into the positions of ``flat`` within ``ranges``."""
    for part, start, stop in pieces(tensors, ranges):
        _scaled_copy(part, _flat_part(flat, part, start, stop), factor)


def copy_out(flat: torch.Tensor, tensors: Sequence[torch.Tensor], factor: float, ranges: Ranges = EVERYTHING) -> None:
    """The reverse of ``copy_into``: fills the parts of ``tensors`` within ``ranges`` from ``flat``, times ``factor``."""
    for part, start, stop in pieces(tensors, ranges):
        _scaled_copy(_flat_part(flat, part, start, stop), part, factor)


def _scaled_copy(source: torch.Tensor, destination: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        destination.copy_(source)
    else:
        torch.mul(source, factor, out=destination)
