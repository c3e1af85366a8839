"""Runs a routing plan during a step: submit a message once all its gradients are ready,
wait for every message in ``synchronize()``, and write results back into ``p.grad``.

Messages start as soon as their last gradient is ready, so communication overlaps the
rest of the backward pass, exactly as Horovod's per-parameter hooks do. Messages on the
parameter server under ASP/SSP exchange no gradients: their variables are stepped
locally and their parameters pushed and pulled after ``step()`` (``after_step``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from hybridsync.backends import Backend, Handle, Reduction, make_backend, make_parameter_sync
from hybridsync.compression import compressor_named
from hybridsync.router.plan import Message, Piece, RoutingPlan


@dataclasses.dataclass(slots=True)
class _InFlight:
    index: int
    message: Message
    handle: Handle | None
    sparse_result: Callable[[], torch.Tensor] | None
    views: list[torch.Tensor]
    sent: list[torch.Tensor]
    contexts: list[Any]
    compressor: Any


class Router:
    """Submits and completes the messages of one plan over the parameters it was built for."""

    def __init__(self, plan: RoutingPlan, params: Sequence[torch.nn.Parameter], *,
                 compression: Any, reduction: Reduction, process_set: Any = None) -> None:
        assert len(params) == len(plan.var_names)
        self.plan = plan
        self._params = list(params)
        self._reduction = reduction
        self._compressors = [compressor_named(m.config.compression, compression) for m in plan.messages]
        self._async = [_is_async(m) for m in plan.messages]
        self._backends = self._make_backends(plan, self._async, process_set)
        self._declare_ps_keys()
        self._parameter_syncs: list[Any] | None = None
        self._waiting_on = [len(m.var_indices) for m in plan.messages]
        self._ready: set[int] = set()
        self._all_vars = frozenset(range(len(self._params)))
        self._in_flight: list[_InFlight] = []

    @staticmethod
    def _make_backends(plan: RoutingPlan, is_async: Sequence[bool], process_set: Any) -> list[Backend | None]:
        """One backend per distinct route (none for ASP/SSP); an unavailable route raises here."""
        users: dict[tuple[str, str], list[str]] = {}
        for message, skip in zip(plan.messages, is_async):
            if not skip:
                users.setdefault(_backend_key(message), []).extend(p.var_name for p in message.pieces)
        backends = {key: make_backend(*key, variables=names, process_set=process_set)
                    for key, names in users.items()}
        return [None if skip else backends[_backend_key(m)] for m, skip in zip(plan.messages, is_async)]

    def _declare_ps_keys(self) -> None:
        """Place every parameter-server message's keys at once, in plan order (identical on all ranks).

        Shapes and wire dtypes come from meta tensors, so nothing is allocated.
        """
        by_backend: dict[int, tuple[Any, list]] = {}
        for message, backend, compressor in zip(self.plan.messages, self._backends, self._compressors):
            declare_all = getattr(backend, "declare_all", None)
            if declare_all is None:
                continue
            sent = [compressor.compress(self._piece_of(piece, self._params[piece.var_index].detach().to("meta")))[0]
                    for piece in message.pieces]
            by_backend.setdefault(id(backend), (declare_all, []))[1].append(
                (message.name, sent, _server_of(message)))
        for declare_all, messages in by_backend.values():
            declare_all(messages)

    def before_step(self) -> None:
        """First call: the ASP/SSP variables join the servers, taking the servers' values.

        Deferred to the first step so that a ``broadcast_parameters`` or checkpoint load
        after the optimizer was built is what the servers start from (the first worker's wins).
        """
        if self._parameter_syncs is not None or not any(self._async):
            return
        by_staleness: dict[int | None, list] = {}
        for message in (m for m, skip in zip(self.plan.messages, self._async) if skip):
            for piece in message.pieces:
                key = message.name if len(message.pieces) == 1 else f"{message.name}.{piece.var_name}"
                view = self._piece_of(piece, self._params[piece.var_index].data)
                by_staleness.setdefault(message.config.staleness, []).append((key, view, _server_of(message)))
        self._parameter_syncs = [make_parameter_sync(pieces, staleness) for staleness, pieces in by_staleness.items()]

    def after_step(self) -> None:
        """Push the ASP/SSP variables' updates and adopt the servers' current values."""
        for sync in self._parameter_syncs or ():
            sync.push_pull()

    @property
    def pending(self) -> bool:
        """True while gradients have been marked ready or messages are in flight this step."""
        return bool(self._ready or self._in_flight)

    def mark_ready(self, var_index: int) -> None:
        """A variable's gradient is final for this step; start every message it completes."""
        if var_index in self._ready:
            return
        self._ready.add(var_index)
        for m_index in self.plan.messages_of_var[var_index]:
            self._waiting_on[m_index] -= 1
            if self._waiting_on[m_index] == 0 and not self._async[m_index]:
                self._submit(m_index)

    def finish(self) -> None:
        """Start what never became ready (zero gradients), wait for all, write results back."""
        lent = []
        for var_index in sorted(self._all_vars - self._ready):
            param = self._params[var_index]
            if not param.requires_grad:
                if self._alone_in_its_messages(var_index):
                    continue  # frozen: never synchronized, never given a gradient
                if param.grad is None:
                    lent.append(param)  # a fused message needs its piece on every rank; taken back below
            if param.grad is None:
                # Another rank may have a gradient here (dynamic graphs): send zeros, as Horovod does.
                param.grad = torch.zeros_like(param)
            self.mark_ready(var_index)
        try:
            # Plan order, identical on every rank: a backend whose wait() blocks on a collective
            # (hierarchical, parameter server) then meets the other ranks at the same message.
            for flight in sorted(self._in_flight, key=lambda f: f.index):
                self._complete(flight)
        finally:
            for param in lent:
                param.grad = None
            self._in_flight.clear()
            self._ready.clear()
            self._waiting_on = [len(m.var_indices) for m in self.plan.messages]

    def _alone_in_its_messages(self, var_index: int) -> bool:
        return all(len(self.plan.messages[m].pieces) == 1 for m in self.plan.messages_of_var[var_index])

    def _submit(self, m_index: int) -> None:
        message = self.plan.messages[m_index]
        backend, compressor = self._backends[m_index], self._compressors[m_index]
        pieces = message.pieces
        if len(pieces) == 1 and pieces[0].whole:
            # The common case (no strategy: one variable per message), kept lean: it runs for
            # every parameter of every step, inside the backward pass.
            grad = self._gradient(pieces[0])
            if not grad.is_sparse:
                sent, ctx = compressor.compress(grad)
                handle = backend.submit(message.name, (sent,), self._reduction)
                self._in_flight.append(_InFlight(m_index, message, handle, None, [grad], [sent], [ctx], compressor))
                return
        grads = [self._gradient(piece) for piece in pieces]
        if any(grad.is_sparse for grad in grads):
            if len(grads) != 1 or not message.pieces[0].whole:
                raise RuntimeError(
                    f"a sparse gradient cannot be partitioned or merged on the all-reduce route "
                    f"(message {message.name!r} holds {', '.join(p.var_name for p in message.pieces)}); "
                    f"give the sparse variable its own entry without 'partitions'/'group'")
            submit_sparse = getattr(backend, "submit_sparse", None)
            assert submit_sparse is not None, f"backend of {message.name!r} lacks sparse support"
            result = submit_sparse(message.name, grads[0], self._reduction)
            self._in_flight.append(_InFlight(m_index, message, None, result, [], [], [], compressor))
            return
        views = [self._piece_of(piece, grad) for piece, grad in zip(message.pieces, grads)]
        sent, contexts = zip(*(compressor.compress(view) for view in views))
        handle = backend.submit(message.name, sent, self._reduction)
        self._in_flight.append(_InFlight(m_index, message, handle, None, views, list(sent), list(contexts), compressor))

    def _gradient(self, piece: Piece) -> torch.Tensor:
        param = self._params[piece.var_index]
        grad = param.grad
        if not grad.is_sparse and not grad.is_contiguous():
            param.grad = grad = grad.contiguous()
        return grad

    @staticmethod
    def _piece_of(piece: Piece, tensor: torch.Tensor) -> torch.Tensor:
        """The piece's rows of a gradient or parameter (a view)."""
        if piece.whole:
            return tensor
        return tensor.narrow(0, piece.start, piece.stop - piece.start)

    def _complete(self, flight: _InFlight) -> None:
        if flight.sparse_result is not None:
            grad = self._params[flight.message.pieces[0].var_index].grad
            grad.zero_().add_(flight.sparse_result())  # sparse tensors do not support set_()
            return
        flight.handle.wait()
        for view, sent, ctx in zip(flight.views, flight.sent, flight.contexts):
            if sent is not view:
                view.copy_(flight.compressor.decompress(sent, ctx))


def _is_async(message: Message) -> bool:
    return message.config.route == "ps" and message.config.protocol in ("asp", "ssp")


def _backend_key(message: Message) -> tuple[str, str]:
    """(route, variant): the all-reduce algorithm, or the parameter-server protocol."""
    config = message.config
    return (config.route, config.algorithm if config.route == "allreduce" else config.protocol)


def _server_of(message: Message) -> int | None:
    """The strategy's server for this message's shard, if it names one."""
    servers = message.config.servers
    return servers[message.pieces[0].shard] if servers else None
