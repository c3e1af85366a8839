"""The small protocols transports implement, and the reduction they are asked for.

The router knows backends only through this module: it hands a backend a list of
tensors that form one message (already compressed, views into gradients where
possible) and gets back a handle; after ``handle.wait()`` returns, the tensors hold
the synchronized values in place. No backend imports another.

Every backend is a ``Backend`` (``submit``). A backend declares what more it can do by
implementing a second small protocol (as PyTorch's ``ddp_comm_hooks`` types its hooks);
the router asks once, with ``isinstance``, when it builds its backends, never per step:

- ``SparseBackend``: ``submit_sparse`` takes a message that is one whole sparse gradient
  as it is (ring: Horovod's sparse all-reduce; PS: touched rows). Without it the router
  makes the gradient dense for the message (as Horovod's ``sparse_as_dense``).
- ``KeyedBackend``: keeps named state per message beyond a step (parameter-server keys).
  The router declares every message it will send up front, in plan order, with its
  tensors' sizes on the wire (``hybridsync.placement``), so every worker places keys alike;
  ``submit_parts`` sends a message holding sparse gradients (a row shard, a merge group)
  as one key per part, sparse parts as touched rows.
- ``StagedBackend``: a handle's collective work starts only once the other ranks of its node
  submitted too (hierarchical all-reduce: the node's sum, then the all-reduce across nodes).
  ``advance`` starts it without waiting when it can; the router advances such messages
  during the backward pass, in one order on every rank (the collectives across nodes must
  meet in the same order), so that their transfers overlap the rest of the backward pass.

One capability is an attribute, not a method: ``waits_in_any_order`` (true on the ring's backend)
says a backend's handles complete on their own (Horovod's background thread), so each rank may wait
for them in the order it submitted them. Without it (a route whose wait may meet the other ranks in
a collective) the router waits for every message of the step in one order on every rank.

The protocols are ``runtime_checkable``: a backend from elsewhere needs only the methods
(structural typing); hybridsync's own backends also name them as bases, so what each
supports reads in its class line. ASP/SSP exchange parameters, not gradients: they are a
``ParameterSync`` (``push_pull`` after each local step), not a backend.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import torch

from hybridsync.placement import Declaration, WireTensor

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


@runtime_checkable
class Backend(Protocol):
    """A transport that synchronizes one message (a list of tensors) across workers."""

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> Handle:
        """Start synchronizing ``tensors`` in place; ``name`` is identical on every rank."""
        ...

    def close(self) -> None:
        """Release what the backend keeps beyond a step (keys, segments, groups); called by every
        rank at a step boundary when the plan that uses it is replaced."""
        ...


SparseResult = Callable[[], torch.Tensor]
"""Waits; returns the reduced sparse gradient."""
PartsResult = Callable[[], "list[torch.Tensor | None]"]
"""Waits; returns, per part, the reduced sparse tensor (``None`` for a dense part, reduced in place)."""


@runtime_checkable
class SparseBackend(Backend, Protocol):
    """A backend that sends a whole sparse gradient as it is."""

    def submit_sparse(self, name: str, grad: torch.Tensor, reduction: Reduction) -> SparseResult:
        """Start reducing sparse ``grad``; the callable waits and returns the reduced sparse tensor."""
        ...


@runtime_checkable
class KeyedBackend(Backend, Protocol):
    """A backend that keeps named state per message (parameter-server keys), declared up front."""

    def declare_all(self, messages: Sequence[Declaration]) -> None:
        """Every message this backend will get, in plan order: ``(name, wire tensors, server or None)``."""
        ...

    def submit_parts(self, name: str, parts: Sequence[tuple[str, torch.Tensor]], reduction: Reduction) -> PartsResult:
        """Send ``(part, tensor)`` pairs of message ``name`` each under its own key; sparse tensors
        as touched rows, dense ones reduced in place."""
        ...


@runtime_checkable
class StagedBackend(Backend, Protocol):
    """A backend whose handles start their collective work in a later stage than ``submit``."""

    def advance(self, handle: Handle) -> bool:
        """Starts ``handle``'s next stage if it can without waiting; true once nothing is left to start
        (``wait`` then only waits). Called in one order on every rank."""
        ...


@runtime_checkable
class ParameterSync(Protocol):
    """ASP/SSP: parameters kept on the servers; the worker steps locally, then calls ``push_pull``."""

    def push_pull(self) -> None:
        """Push the local update since the last pull; adopt the servers' current values."""
        ...

    def pull(self) -> None:
        """Adopt the servers' current values without pushing (a switch back to BSP)."""
        ...

    def close(self) -> None:
        """Stop using these parameters' keys (``Router.close``: the plan was replaced)."""
        ...


class BackendFactory(Protocol):
    """Makes the backend of one route (``make_backend``; a test passes a fake)."""

    def __call__(self, route: str, variant: str, variables: Sequence[str] = (), namespace: str = "",
                 process_set: Any = None) -> Backend:
        ...


class ParameterSyncFactory(Protocol):
    """Makes the ASP/SSP sync of ``(key name, tensor, server or None)`` pieces (``make_parameter_sync``)."""

    def __call__(self, pieces: Sequence[tuple[str, torch.Tensor, int | None]], staleness: int | None,
                 namespace: str = "") -> ParameterSync:
        ...


def wire_of(tensors: Sequence[torch.Tensor | WireTensor]) -> tuple[WireTensor, ...]:
    """Tensors as the placement sees them (sizes and dtypes only; ``WireTensor`` passes through)."""
    return tuple(t if isinstance(t, WireTensor) else
                 WireTensor(numel=t.numel(), dtype=str(t.dtype).removeprefix("torch."), itemsize=t.element_size())
                 for t in tensors)


class RouteUnavailableError(ValueError):
    """A strategy asks for a route or algorithm this installation cannot run."""
