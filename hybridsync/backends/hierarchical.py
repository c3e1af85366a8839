"""Hierarchical all-reduce from Horovod process sets, selectable per message.

Three steps, each on one of the process sets ``hs.init()`` declares:

1. all-reduce of the whole message within the node (``intra_node``);
2. each rank takes its own ``1/local_size`` slice of the node's sum and all-reduces it
   with the ranks that share its local rank on the other nodes (``cross_node``), so every
   rank's uplink is busy at once and each carries ``1/local_size`` of the message;
3. all-gather of the slices within the node.

The cross-node traffic is that of the bandwidth-optimal form Horovod uses with NCCL, whose
first step is a reduce-scatter; the intra-node all-reduce moves about twice a
reduce-scatter's bytes within the node instead. That trade is deliberate: Horovod
0.28.1's Gloo ``reducescatter`` on a process set intermittently returned wrong sums (one
contribution counted twice) and sometimes hung for 64 MiB buffers on the emulated cluster,
and was 3-6x slower than a Gloo all-reduce of the same buffer
(``tests/workers/reducescatter_stress.py`` reproduces it; benchmarks/RESULTS.md). An
intra-node alltoall plus a local sum was also correct, but slower here than the all-reduce
(64 MiB on 2 x 2 emulated hosts: median 1.7-2.3 s vs 1.2-1.7 s per op).

A message's tensors travel as one flat buffer padded to a multiple of the node size, so
every rank's slice has the same length. Where one level has a single member (one node,
or one rank per node) the message is one plain all-reduce on the other level.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridsync.backends.base import Reduction, RouteUnavailableError
from hybridsync.backends.waiting import wait
from hybridsync.topology import HierarchicalSets, hierarchical_sets


def flatten_padded(tensors: Sequence[torch.Tensor], multiple: int) -> tuple[torch.Tensor, int]:
    """A fresh flat copy of ``tensors`` zero-padded to a multiple of ``multiple``, and the unpadded length.

    Fresh, so the collectives may work on it in place without touching the caller's tensors.
    """
    flat = torch.cat([t.reshape(-1) for t in tensors])
    numel = flat.numel()
    pad = (-numel) % multiple
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat, numel


def node_slice(node_sum: torch.Tensor, local_size: int, local_rank: int) -> torch.Tensor:
    """The contiguous ``1/local_size`` of the node's sum that this rank carries across nodes (a view)."""
    assert node_sum.numel() % local_size == 0, (node_sum.numel(), local_size)
    length = node_sum.numel() // local_size
    return node_sum[local_rank * length:(local_rank + 1) * length]


def start_first_step(hvd: Any, flat: torch.Tensor, sets: HierarchicalSets, name: str) -> int:
    """Starts the in-place all-reduce of ``flat`` on the node's set (or, with one rank per node, across nodes)."""
    process_set = sets.intra_node if sets.intra_node is not None else sets.cross_node
    assert process_set is not None, "a job of one rank has no hierarchical sets"
    return hvd.allreduce_async_(flat, name=f"{name}.iar" if sets.intra_node is not None else f"{name}.ar",
                                op=hvd.Sum, process_set=process_set)


def finish_across_nodes(hvd: Any, node_sum: torch.Tensor, sets: HierarchicalSets, name: str) -> torch.Tensor:
    """Steps 2 and 3 on a buffer already summed within the node: the global sum, padded length."""
    # hs.init() checked that local rank == position in the node's set (ranks laid out node by node),
    # which is the order in which all-gather concatenates the slices.
    shard = node_slice(node_sum, sets.local_size, hvd.local_rank())
    wait(hvd, hvd.allreduce_async_(shard, name=f"{name}.ar", op=hvd.Sum, process_set=sets.cross_node))
    return wait(hvd, hvd.allgather_async(shard, name=f"{name}.ag", process_set=sets.intra_node))


class _HierarchicalHandle:
    """The first all-reduce is started at submit; the cross-node and all-gather steps run in ``wait()``.

    The router waits messages in plan order on every rank, so the blocking steps meet up.
    """

    def __init__(self, backend: "HierarchicalAllreduce", name: str, tensors: Sequence[torch.Tensor],
                 reduction: Reduction) -> None:
        self._backend, self._name, self._tensors, self._reduction = backend, name, tensors, reduction
        flat, _ = flatten_padded(tensors, backend.sets.local_size)
        if reduction.prescale_factor != 1.0:
            flat.mul_(reduction.prescale_factor)
        self._flat = flat
        self._first = start_first_step(backend.hvd, flat, backend.sets, name)

    def wait(self) -> None:
        hvd, sets = self._backend.hvd, self._backend.sets
        wait(hvd, self._first)  # in place: self._flat now holds the node's sum (or the total)
        both_levels = sets.intra_node is not None and sets.cross_node is not None
        total = finish_across_nodes(hvd, self._flat, sets, self._name) if both_levels else self._flat
        self._write_back(total)

    def _write_back(self, total: torch.Tensor) -> None:
        """Copies the reduced buffer into the message's tensors, with average and postscale applied."""
        scale = self._reduction.postscale_factor / (self._backend.hvd.size() if self._reduction.op == "average"
                                                    else 1)
        offset = 0
        for tensor in self._tensors:
            n = tensor.numel()
            tensor.copy_(total[offset:offset + n].view_as(tensor))
            if scale != 1.0:
                tensor.mul_(scale)
            offset += n


class HierarchicalAllreduce:
    """Per-message hierarchical all-reduce over the node/local-rank process sets of ``hs.init()``."""

    def __init__(self) -> None:
        import horovod.torch as hvd
        self.hvd = hvd
        try:
            sets: HierarchicalSets | None = hierarchical_sets()
            problem = None
        except RuntimeError as e:
            sets, problem = None, str(e)
        # Every rank must agree before any of them relies on the sets, or one would hang.
        problems = [p for p in hvd.allgather_object(problem, name="hybridsync.hierarchical_check") if p]
        if problems:
            raise RouteUnavailableError(f"{problems[0]} (reported by {len(problems)} of {hvd.size()} ranks)")
        assert sets is not None
        self.sets = sets

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> Any:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise RuntimeError(f"message {name!r} mixes dtypes {sorted(map(str, dtypes))}; hierarchical "
                               f"all-reduce sends a message as one buffer")
        return _HierarchicalHandle(self, name, tensors, reduction)
