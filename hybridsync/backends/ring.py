"""Horovod ring all-reduce: one async (grouped) all-reduce per message."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hybridsync.backends.base import Reduction
from hybridsync.backends.waiting import wait


def horovod_op(reduction: Reduction) -> Any:
    """Horovod's op constant for a ``Reduction``."""
    import horovod.torch as hvd
    return hvd.Average if reduction.op == "average" else hvd.Sum


class _HorovodHandle:
    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> None:
        wait(self._hvd, self._handle)


class RingAllreduce:
    """Ring all-reduce through Horovod; a merged message becomes one grouped all-reduce."""

    def __init__(self, process_set: Any = None) -> None:
        import horovod.torch as hvd
        self._hvd = hvd
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._kwargs: dict[Reduction, dict[str, Any]] = {}
        self._last: tuple[Reduction | None, dict[str, Any]] = (None, {})

    def _op_kwargs(self, reduction: Reduction) -> dict[str, Any]:
        # Built once per reduction: this runs for every message of every step (the router
        # passes the same Reduction object each time, so the identity check usually answers).
        if reduction is self._last[0]:
            return self._last[1]
        if reduction not in self._kwargs:
            self._kwargs[reduction] = dict(op=horovod_op(reduction), prescale_factor=reduction.prescale_factor,
                                           postscale_factor=reduction.postscale_factor,
                                           process_set=self._process_set)
        self._last = (reduction, self._kwargs[reduction])
        return self._last[1]

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> _HorovodHandle:
        kwargs = self._op_kwargs(reduction)
        if len(tensors) == 1:
            return _HorovodHandle(self._hvd, self._hvd.allreduce_async_(tensors[0], name=name, **kwargs))
        return _HorovodHandle(self._hvd, self._hvd.grouped_allreduce_async_(list(tensors), name=name, **kwargs))

    def submit_sparse(self, name: str, grad: torch.Tensor, reduction: Reduction) -> Callable[[], torch.Tensor]:
        """Sparse gradients as Horovod sends them: all-gather of indices and values."""
        return self._hvd.sparse_allreduce_async(grad, name=name, op=horovod_op(reduction),
                                                process_set=self._process_set)
