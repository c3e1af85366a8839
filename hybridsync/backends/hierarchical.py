"""Hierarchical all-reduce from Horovod process sets, selectable per message.

The bandwidth-optimal form Horovod uses with NCCL: reduce-scatter within the node, all-
reduce each shard among the ranks that share a local rank (every rank's uplink busy at
once), all-gather within the node. A message's tensors travel as one flat buffer padded
to a multiple of the node size, so every rank's shard has the same length.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridsync.backends.base import Reduction, RouteUnavailableError
from hybridsync.topology import HierarchicalSets, hierarchical_sets


class _HierarchicalHandle:
    """Reduce-scatter is started at submit; the cross-node and all-gather steps run in ``wait()``.

    The router waits messages in plan order on every rank, so the blocking steps meet up.
    """

    def __init__(self, backend: "HierarchicalAllreduce", name: str, tensors: Sequence[torch.Tensor],
                 reduction: Reduction) -> None:
        self._backend, self._name, self._tensors, self._reduction = backend, name, tensors, reduction
        hvd, sets = backend.hvd, backend.sets
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._numel = flat.numel()
        pad = (-self._numel) % sets.local_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        if reduction.prescale_factor != 1.0:
            flat.mul_(reduction.prescale_factor)
        self._flat = flat
        self._scatter = (hvd.reducescatter_async(flat, name=f"{name}.rs", op=hvd.Sum, process_set=sets.intra_node)
                         if sets.intra_node is not None else None)

    def wait(self) -> None:
        hvd, sets = self._backend.hvd, self._backend.sets
        shard = hvd.synchronize(self._scatter) if self._scatter is not None else self._flat
        if sets.cross_node is not None:
            shard = hvd.allreduce(shard, name=f"{self._name}.ar", op=hvd.Sum, process_set=sets.cross_node)
        full = (hvd.allgather(shard, name=f"{self._name}.ag", process_set=sets.intra_node)
                if sets.intra_node is not None else shard)
        scale = self._reduction.postscale_factor / (hvd.size() if self._reduction.op == "average" else 1)
        offset = 0
        for tensor in self._tensors:
            n = tensor.numel()
            tensor.copy_(full[offset:offset + n].view_as(tensor))
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
