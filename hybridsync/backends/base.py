"""The small protocol every transport implements, and the reduction it is asked for.

The router knows backends only through this module: it hands a backend a list of
tensors that form one message (already compressed, views into gradients where
possible) and gets back a handle; after ``handle.wait()`` returns, the tensors hold
the synchronized values in place. No backend imports another.

Two optional methods let a backend take sparse gradients as they are (the router makes
them dense for a backend that has neither): ``submit_sparse(name, grad, reduction)`` for a
message that is one whole sparse gradient (ring: Horovod's sparse all-reduce; PS: touched
rows), and ``submit_parts(name, [(part, tensor), ...], reduction)`` for a message mixing
sparse row shards and dense pieces (PS). Both return a callable that waits and returns
the reduced sparse tensor(s).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Protocol, Sequence

import torch

ReduceOp = Literal["average", "sum"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reduction:
    """How the workers' tensors are combined (mirrors Horovod's op and scale factors)."""

    op: ReduceOp = "average"
    """``average`` divides the sum by the number of workers, ``sum`` does not."""
    prescale_factor: float = 1.0
    """Each worker multiplies its tensor by this before the reduction."""
    postscale_factor: float = 1.0
    """The reduced tensor is multiplied by this afterwards."""

    def result_factor(self, num_workers: int) -> float:
        """What a backend multiplies the plain sum by: the postscale, and 1/num_workers for an average."""
        return self.postscale_factor / (num_workers if self.op == "average" else 1)


class Handle(Protocol):
    """An in-flight synchronization of one message."""

    def wait(self) -> None:
        """Block until the message's tensors hold the synchronized values."""
        ...


class Backend(Protocol):
    """A transport that synchronizes one message (a list of tensors) across workers."""

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> Handle:
        """Start synchronizing ``tensors`` in place; ``name`` is identical on every rank."""
        ...

    def close(self) -> None:
        """Release what the backend keeps beyond a step (keys, segments, groups); called by every
        rank at a step boundary when the plan that uses it is replaced."""
        ...


class RouteUnavailableError(ValueError):
    """A strategy asks for a route or algorithm this installation cannot run."""
