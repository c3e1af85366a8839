"""The ``shm`` intra-node transport of hierarchical all-reduce: one message through a node's shared segment.

Per use of a message, on every rank of the node (``node_memory`` describes the segment):

1. submit: copy the parts of the message the other ranks sum (their slices) into this
   rank's input region, then publish "input written".
2. advance (the router calls it during the backward pass; ``wait`` does it if it has not
   happened): once every rank's input is written, sum this rank's slice (its own part
   straight from its tensors, the others' from their regions) into the output region, and
   start its all-reduce across nodes, which then travels while the backward pass goes on.
3. wait: while that runs, copy each other rank's slice out as soon as that rank publishes
   it final; when this rank's own is final, publish it and copy it out.

No collective among the node's ranks and no barrier: a rank waits only for the slices it
reads. Counters are use numbers, so the same segment serves every step: a rank cannot
write its input for use n+1 before every rank has read its input of use n (it waits, in
use n, for their outputs, which they publish after reading), nor its output slice before
every rank has copied it (use n+1's inputs are written only after use n is complete).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hybridsync.backends.hierarchical.groups import Group
from hybridsync.backends.hierarchical.flat_buffers import copy_into, copy_out, pieces, slice_range
from hybridsync.backends.hierarchical.node_memory import NodeSegment


class SharedMemoryHandle:
    """One message's hierarchical all-reduce through ``segment``: the copy in at construction
    (submit), the node's sum and the start across nodes in ``advance()`` (or ``wait()``), the
    rest in ``wait()``."""

    def __init__(self, cross_node: Group | None, segment: NodeSegment, use: int, name: str,
                 tensors: Sequence[torch.Tensor], prescale: float, postscale: float) -> None:
        self._cross_node, self._segment, self._use = cross_node, segment, use
        self._name, self._tensors, self._prescale, self._postscale = name, tensors, prescale, postscale
        local_size, me = len(segment.inputs), segment.local_rank
        padded = segment.output.numel()
        self._ranges = [slice_range(padded, local_size, i) for i in range(local_size)]
        # Slices are views into the tensors only where they are contiguous; otherwise this rank
        # copies (and sums from) its whole message, and copies the result out at the end, whole.
        self._by_slice = all(t.is_contiguous() for t in tensors)
        others = [r for i, r in enumerate(self._ranges) if i != me]
        copy_into(tensors, segment.inputs[me], prescale, others if self._by_slice else ((0, padded),))
        segment.inputs_done[me] = use
        self._in_flight: list | None = None
        """The all-reduce across nodes once started (empty on a single node); ``None`` before."""

    def advance(self) -> bool:
        """Sums this rank's slice and starts its all-reduce across nodes if every rank of the node has
        written its input; never waits. True once started."""
        if self._in_flight is None:
            if not self._inputs_written():
                return False
            self._start()
        return True

    def _inputs_written(self) -> bool:
        return bool((self._segment.inputs_done >= self._use).all())

    def _start(self) -> None:
        lo, hi = self._ranges[self._segment.local_rank]
        self._segment.unlink()  # every rank of the node has mapped it: each wrote its input
        shard = self._segment.output[lo:hi]
        self._sum_slice(shard, lo, hi)
        self._in_flight = [] if self._cross_node is None else [
            self._cross_node.allreduce_async(shard, f"{self._name}.ar")]

    def wait(self) -> None:
        segment, use, me = self._segment, self._use, self._segment.local_rank
        lo, hi = self._ranges[me]
        if self._in_flight is None:
            segment.wait_until(self._inputs_written,
                               lambda: [i for i, n in enumerate(segment.inputs_done.tolist()) if n < use],
                               f"waiting for its inputs to message {self._name!r}")
            self._start()
        in_flight = self._in_flight
        unread = [i for i in range(len(self._ranges)) if i != me]

        def read_final_slices() -> bool:
            """Copies out the slices published since the last call; true once none is unread and
            this rank's own all-reduce across nodes is done."""
            for i in [i for i in unread if int(segment.outputs_done[i]) >= use]:
                if self._by_slice:
                    copy_out(segment.output, self._tensors, self._postscale, [self._ranges[i]])
                unread.remove(i)
            return not in_flight or in_flight[0].done()

        what = f"waiting for the final slices of message {self._name!r}"
        segment.wait_until(read_final_slices, lambda: unread, what)
        if in_flight:
            in_flight.pop().wait()
        segment.outputs_done[me] = use
        if self._by_slice:
            copy_out(segment.output, self._tensors, self._postscale, [(lo, hi)])
        segment.wait_until(lambda: read_final_slices() and not unread, lambda: unread, what)
        if not self._by_slice:
            copy_out(segment.output, self._tensors, self._postscale)

    def _sum_slice(self, shard: torch.Tensor, lo: int, hi: int) -> None:
        """``shard`` = this rank's slice of every rank's (prescaled) message, summed."""
        me = self._segment.local_rank
        others = [region[lo:hi] for i, region in enumerate(self._segment.inputs) if i != me]
        if self._by_slice:
            # Own part from the tensors; positions past the message (padding) stay zero.
            for part, start, stop in pieces(self._tensors, [(lo, hi)]):
                torch.add(others[0][start - lo:stop - lo], part.reshape(-1), alpha=self._prescale,
                          out=shard[start - lo:stop - lo])
        else:
            torch.add(others[0], self._segment.inputs[me][lo:hi], out=shard)
        for region in others[1:]:
            shard.add_(region)
