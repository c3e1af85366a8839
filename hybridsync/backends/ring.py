"""Horovod ring all-reduce: one async (grouped) all-reduce per message."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hybridsync.backends.base import Reduction, SparseBackend
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


class RingAllreduce(SparseBackend):
    """Ring all-reduce through Horovod; a merged message becomes one grouped all-reduce."""

    waits_in_any_order = True
    """Horovod completes the handles on its own thread: a rank may wait in its submission order."""

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

    def close(self) -> None:
        """Nothing to release: Horovod's ring needs no state beyond a step."""

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> _HorovodHandle:
        kwargs = self._op_kwargs(reduction)
        if len(tensors) == 1:
            return _HorovodHandle(self._hvd, self._hvd.allreduce_async_(tensors[0], name=name, **kwargs))
        return _HorovodHandle(self._hvd, self._hvd.grouped_allreduce_async_(list(tensors), name=name, **kwargs))

    def submit_sparse(self, name: str, grad: torch.Tensor, reduction: Reduction) -> Callable[[], torch.Tensor]:
        """Sparse gradients as Horovod sends them (``sparse_allreduce_async``): all-gather of the
        indices and of the values, the values divided by the ranks for an average. Waited for
        with ``waiting.wait``, so ``HYBRIDSYNC_WAIT=sleep`` holds for sparse gradients too.

        Horovod's own sparse all-reduce ignores the scale factors; here they apply (the sum is
        linear: their product, once, on the gathered values), so that a dense gradient sent as its
        rows (``VarConfig.rows``) reduces as its all-reduce would. The optimizer's factors
        (``gradient_predivide_factor``: 1/f before, f after) multiply to 1 and change nothing (to rounding)."""
        scale = reduction.prescale_factor * reduction.postscale_factor
        hvd, process_set = self._hvd, self._process_set
        # all-gather concatenates along dim 0: indices travel as (nnz, sparse_dim).
        indices = hvd.allgather_async(grad._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                                      process_set=process_set)
        values = hvd.allgather_async(grad._values(), name=f"{name}.values", process_set=process_set)

        def result() -> torch.Tensor:
            gathered_values = wait(hvd, values)  # values first, as Horovod does (horovod#2961)
            gathered_indices = wait(hvd, indices)
            if reduction.op == "average":
                gathered_values = gathered_values / process_set.size()
            if scale != 1.0:
                gathered_values = gathered_values * scale
            # Every rank's rows of a valid gradient: in range. Saying so explicitly also keeps torch
            # (>= 2.13) from warning, once per process, that the checks are "implicitly disabled".
            if gathered_indices.dim() == 0 or gathered_values.dim() == 0:  # nothing touched anywhere
                return torch.sparse_coo_tensor(size=grad.size(), dtype=grad.dtype, check_invariants=False)
            return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, grad.size(),
                                           check_invariants=False)
        return result
