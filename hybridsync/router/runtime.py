"""Runs a routing plan during a step: submit a message once all its gradients are ready,
wait for every message in ``synchronize()``, and write results back into ``p.grad``.

Messages start as soon as their last gradient is ready, so communication overlaps the
rest of the backward pass, exactly as Horovod's per-parameter hooks do. A hierarchical
message's all-reduce across nodes must meet the other ranks' in one order, and can start only
once its node's ranks all submitted it: the router advances those messages from the gradient
hooks in one order on every rank (``_staged``), each as soon as the ones before it started, and
``finish()`` waits in that order. The order is learned: the first step uses reverse plan order
(a plan lists variables as the model declares them), then every rank adopts the order in which
the first rank submitted them (its backward pass's), so a model that declares its layers in
another order than it uses them still overlaps. Messages on the
parameter server under ASP/SSP exchange no gradients: their variables are stepped
locally and their parameters pushed and pulled after ``step()`` (``after_step``).

Sparse gradients (``nn.Embedding(sparse=True)``) are handled on every route and shape,
since the optimizer cannot know them before the first step: a whole variable goes as
the backend sends sparse tensors (Horovod's sparse all-reduce, the PS's touched rows);
on the parameter server a shard or merge-group member goes as its own key, touched rows
only (indices re-based to the shard); on the all-reduce routes a partitioned or merged
sparse gradient, and any sparse gradient on the hierarchical backend (the route's, where it
is not the ring's: ``make_backend``), is made dense for
the message (as Horovod's ``sparse_as_dense``: correct, at the variable's full bytes).
The result goes back into ``p.grad`` as a sparse tensor, as the optimizer expects.

A dense gradient the strategy sends as its nonzero rows (``VarConfig.rows``: an
``nn.Embedding(sparse=False)``, whose gradient is zero but for the rows a batch touched) is
turned, once per step, into a coalesced sparse gradient of those rows and sent on the same
sparse paths (the plan allows it only where one can travel: the PS under BSP, or a whole
variable on the ring); the reduced rows are written back into the zeroed dense ``p.grad``.
Lossless: rows zero on every rank stay zero. Such a variable stays dense for the gradient-kind
agreement and the optimizer, and a message holding none pays one list look-up for it.

Whether a variable's gradient is sparse is agreed by the ranks before its first message
goes out: a rank whose sparse embedding got no gradient in a step must send sparse zeros,
not dense ones, or it would wait forever for a collective the others never start. Until a
variable has been seen with a gradient on some rank (``GradientKinds``), the messages that
could travel sparse wait for ``finish()``, where one small all-gather of each rank's kinds
decides (a variable dense on one rank and sparse on another is a ``ValueError`` on every
rank). Usually that is the first step only; an optimizer's later plans (``set_strategy``)
keep what was agreed.

Backends are known only by ``backends/base.py``'s protocols: what a backend can do beyond
``submit`` (sparse gradients, keys declared up front) is asked once, with ``isinstance``,
when the router is built. Key names, servers and wire sizes come from the plan.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch

from hybridsync.backends import (Backend, BackendFactory, Handle, KeyedBackend, ParameterSync, ParameterSyncFactory,
                                 Reduction, SparseBackend, StagedBackend, make_backend, make_parameter_sync)
from hybridsync.backends import stalls
from hybridsync.backends.base import wire_of
from hybridsync.compression import compressor_named, nonzero_row_indices
from hybridsync.router.plan import Message, Piece, RoutingPlan


_routers_created = 0
"""Routers built in this process so far: every rank builds the same ones, in the same order."""


def next_instance() -> int:
    """The number the next ``Router`` built in this process takes unless it is given one."""
    return _routers_created


def _take_instance(instance: int | None) -> int:
    global _routers_created
    instance = _routers_created if instance is None else instance
    _routers_created = max(_routers_created, instance + 1)
    return instance


class GradientKinds:
    """Which variables' gradients are sparse, as every rank agreed; shared by an optimizer's routers."""

    def __init__(self) -> None:
        self.sparse: set[int] = set()
        """Variables seen with a sparse gradient: one that gets none is sent as sparse zeros."""
        self.decided: set[int] = set()
        """Variables whose kind the ranks agreed on (seen with a gradient on some rank)."""


KindsExchange = Callable[[list[int], str], list[list[int]]]
"""Every rank's list of small ints, in rank order (collective over the router's process set)."""

_NO_GRADIENT, _DENSE, _SPARSE, _UNTOUCHED = 0, 1, 2, 3
"""A variable's state in the gradient-kind agreement. ``_UNTOUCHED``: no backward pass of the step wrote
its ``p.grad``, which holds a tensor all the same (``zero_grad(set_to_none=False)``'s zeros, a gradient set
by hand, a parameter unfrozen after the optimizer was built): no kind, but maybe values to send."""


@dataclasses.dataclass(slots=True)
class _InFlight:
    index: int
    message: Message
    handle: Handle | None
    sparse_result: Callable[[], list[torch.Tensor | None]] | None
    """Waits; returns a reduced sparse tensor (or ``None``) per entry of ``sparse_rows``."""
    views: list[torch.Tensor]
    sent: list[torch.Tensor]
    contexts: list[Any]
    compressor: Any
    sparse_rows: list[tuple[int, int] | None] = dataclasses.field(default_factory=list)
    """Per sparse result: (variable index, first row of its shard), or ``None`` for a dense part."""


class Router:
    """Submits and completes the messages of one plan over the parameters it was built for."""

    def __init__(self, plan: RoutingPlan, params: Sequence[torch.nn.Parameter], *,
                 compression: Any, reduction: Reduction, process_set: Any = None, sparse_as_dense: bool = False,
                 backends: BackendFactory = make_backend,
                 parameter_syncs: ParameterSyncFactory = make_parameter_sync,
                 kinds: GradientKinds | None = None, exchange: KindsExchange | None = None,
                 instance: int | None = None, scoped_names: bool = False) -> None:
        """``sparse_as_dense``: every sparse gradient is made dense for its message, whatever the
        backend could send (Horovod's option). ``backends`` and ``parameter_syncs`` make the
        transports, ``exchange`` the all-gather that agrees on gradient kinds (a test passes
        fakes); ``kinds``: what earlier routers over the same parameters agreed. ``instance``:
        the number the ranks agreed on, when their processes built different numbers of routers
        before (a worker that joined an elastic job); by default ``next_instance()``. Either way
        the next router numbers past it.

        ``scoped_names``: every message goes out under a name of this router's own,
        ``opt<instance>.<message name>``, not the plan's (an unsplit variable's message has the
        variable's name). For an elastic job: a reset abandons a plan mid-step, and a message
        Horovod still holds under a name makes the next plan's message of that name fail ("a
        tensor with the same name as another tensor that is currently being processed");
        routers' numbers only grow, so their names never meet."""
        assert len(params) == len(plan.var_names)
        self.instance = _take_instance(instance)
        """Identical on every rank (the optimizer's fingerprint check covers it)."""
        self.namespace = f"opt{self.instance}"
        """Prefix of every name kept beyond a step (parameter-server keys): two routers never share one."""
        self._names = [f"{self.namespace}.{m.name}" if scoped_names else m.name for m in plan.messages]
        """Each message's name on the wire, by index: the plan's, or with ``scoped_names`` this router's."""
        self.plan = plan
        self.closed = False
        """Set by ``close()``: the plan's keys, segments and groups are released."""
        self._params = list(params)
        self._reduction = reduction
        self._sparse_as_dense = sparse_as_dense
        self._compressors = [compressor_named(m.config.compression, compression) for m in plan.messages]
        self._async = [m.exchanges_parameters for m in plan.messages]
        self._exchanges_parameters = any(self._async)
        self._backends = self._make_backends(plan, self._async, self.namespace, process_set, backends)
        # What each message's backend can do beyond submit, asked once (base.py's protocols).
        self._sparse = [b if isinstance(b, SparseBackend) else None for b in self._backends]
        self._keyed = [b if isinstance(b, KeyedBackend) else None for b in self._backends]
        self._declare_keys()
        self._make_parameter_sync = parameter_syncs
        self._parameter_syncs: list[ParameterSync] | None = None
        self._sizes = tuple(len(m.var_indices) for m in plan.messages)
        """Per message, how many variables feed it: ``_waiting_on``'s value at the start of a step."""
        self._waiting_on = list(self._sizes)
        self._in_plan_order = any(not getattr(b, "waits_in_any_order", False) for b in self._backends if b is not None)
        """Whether ``finish()`` waits in one order on every rank (``_position``'s with staged messages,
        else plan order): a route whose wait blocks on a collective needs it (every rank meets the
        others at the same message); Horovod's ring handles complete on Horovod's own thread, so a
        plan whose backends are all the ring's (hierarchical messages too, where ``make_backend`` gives
        them the ring) waits in the order it submitted, as Horovod does."""
        self._staged = [m for m in reversed(range(len(plan.messages))) if isinstance(self._backends[m], StagedBackend)]
        """Messages whose collectives start after submit (``StagedBackend``: hierarchical all-reduce), in
        the order every rank starts them, which ``finish()`` keeps. Advanced on every gradient hook, so
        that they travel while the backward pass goes on. Reverse plan order (the backward pass's
        usual order) until the ranks agree on the first step's (``_agree_on_order``)."""
        self._position = {m: len(plan.messages) - 1 - m for m in range(len(plan.messages))}
        """With staged messages, each message's place in the order ``finish()`` waits in: ``_staged``'s
        order, the other messages among them."""
        self._next_staged = 0
        """This step's first message of ``_staged`` not started yet."""
        self._staged_flights: dict[int, _InFlight] = {}
        """This step's submitted messages by index, while the plan has staged messages."""
        self._ready: set[int] = set()
        self._all_vars = frozenset(range(len(self._params)))
        self._in_flight: list[_InFlight] = []
        self._kinds = kinds if kinds is not None else GradientKinds()
        self._sparse_vars = self._kinds.sparse
        self._exchange = exchange or _horovod_exchange(process_set)
        self._held = self._undecided_messages()
        """Messages whose kind is not agreed yet: submitted in ``finish()``, after the agreement."""
        self._steps = 0
        """``finish()`` calls so far: the step number the stall watch reports."""
        self._sparse_results: dict[int, list[torch.Tensor]] = {}
        self._densified: dict[int, torch.Tensor] = {}
        """This step's sparse gradients made dense for an all-reduce, by variable index."""
        self.sent_dense: set[int] = set()
        """Variables whose sparse gradient the strategy made this router send dense (at the variable's
        full size) though ``sparse_as_dense`` did not ask for it: the optimizer warns of them once."""
        self._as_rows = [any(piece.rows for piece in m.pieces) for m in plan.messages]
        """Per message, whether it holds a dense gradient sent as its nonzero rows (``Piece.rows``)."""
        self._rows: dict[int, torch.Tensor] = {}
        """This step's dense gradients as sparse tensors of their nonzero rows, by variable index."""

    @staticmethod
    def _make_backends(plan: RoutingPlan, is_async: Sequence[bool], namespace: str,
                       process_set: Any, factory: BackendFactory) -> list[Backend | None]:
        """One backend per distinct route (none for ASP/SSP); an unavailable route raises here."""
        users: dict[tuple[str, str], list[str]] = {}
        for message, skip in zip(plan.messages, is_async):
            if not skip:
                users.setdefault(_backend_key(message), []).extend(p.var_name for p in message.pieces)
        backends = {key: factory(*key, variables=names, namespace=namespace, process_set=process_set)
                    for key, names in users.items()}
        return [None if skip else backends[_backend_key(m)] for m, skip in zip(plan.messages, is_async)]

    def _declare_keys(self) -> None:
        """Tell each keyed backend (parameter servers) every message it will get, at once, in plan order
        (identical on all ranks), with its tensors' sizes on the wire and the strategy's server.

        The sizes come from this optimizer's compressor applied to meta tensors (nothing is
        allocated), so a custom compressor is described as it really sends; for ``none`` and
        ``fp16`` they equal the plan's ``Message.wire``.
        """
        by_backend: dict[int, tuple[KeyedBackend, list]] = {}
        for message, name, backend, compressor in zip(self.plan.messages, self._names, self._keyed, self._compressors):
            if backend is not None:
                sent = [compressor.compress(self._piece_of(piece, self._params[piece.var_index].detach().to("meta")))[0]
                        for piece in message.pieces]
                declaration = (name, wire_of(sent), message.server)
                by_backend.setdefault(id(backend), (backend, []))[1].append(declaration)
        for backend, messages in by_backend.values():
            backend.declare_all(messages)

    def _undecided_messages(self) -> frozenset[int]:
        """Messages that could travel sparse and hold a variable of undecided kind."""
        if self._sparse_as_dense:
            return frozenset()
        return frozenset(
            index for index, message in enumerate(self.plan.messages)
            if not self._async[index] and (self._keyed[index] is not None or (
                self._sparse[index] is not None and len(message.pieces) == 1 and message.pieces[0].whole))
            and not message.var_indices <= self._kinds.decided)

    def before_step(self) -> None:
        """First call: the ASP/SSP variables join the servers, taking the servers' values.

        Deferred to the first step so that a ``broadcast_parameters`` or checkpoint load
        after the optimizer was built is what the servers start from (the first worker's wins).
        """
        if self._parameter_syncs is not None or not self._exchanges_parameters:
            return
        self._parameter_syncs = [
            self._make_parameter_sync([(key, self._piece_of(piece, self._params[piece.var_index].data), server)
                                       for key, piece, server in pieces], staleness, self.namespace)
            for staleness, pieces in self.plan.parameter_syncs()]

    def after_step(self) -> None:
        """Push the ASP/SSP variables' updates and adopt the servers' current values."""
        for sync in self._parameter_syncs or ():
            sync.push_pull()

    def pull_parameters(self) -> None:
        """ASP/SSP variables: adopt the servers' current values, pushing nothing. Called on every
        rank once every rank's last push is in, it makes their parameters identical again."""
        for sync in self._parameter_syncs or ():
            sync.pull()

    def close(self) -> None:
        """Release what this plan holds beyond a step: its PS keys (here and, once every worker
        released them, on the servers), its shared-memory segments, its share of the
        hierarchical groups. Collective: every rank closes the same router at a step boundary
        (``DistributedOptimizer.set_strategy``). Idempotent; a closed router is never used again.
        """
        if self.pending:
            raise RuntimeError("a router cannot be closed while gradients of this step are in flight")
        if self.closed:
            return
        self.closed = True
        for backend in {id(b): b for b in self._backends if b is not None}.values():
            backend.close()
        for sync in self._parameter_syncs or ():
            sync.close()

    def abandon(self) -> None:
        """Forget the step in flight and release this plan's resources, talking to no other rank.

        For a world that is gone (a rank died, or an elastic reset re-formed the job): its
        collectives cannot complete. ``close`` of each backend lets go of the hierarchical
        route's groups (``backends.forget_world`` closes them whoever holds them). Idempotent.
        """
        self._forget_step()
        self.close()

    def _forget_step(self) -> None:
        """Nothing of this step stays: the next starts afresh."""
        self._in_flight.clear()
        self._staged_flights.clear()
        self._next_staged = 0
        self._ready.clear()
        self._sparse_results.clear()
        self._densified.clear()
        self._rows.clear()
        self._waiting_on = list(self._sizes)

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
            if self._waiting_on[m_index] == 0 and not self._async[m_index] and m_index not in self._held:
                self._submit(m_index)
        if self._staged:
            self._advance_staged()

    def _advance_staged(self) -> None:
        """Starts the staged messages that can start without waiting, in ``_staged``'s order; stops at
        the first that cannot (not submitted yet, or its node's other ranks not there yet)."""
        order, flights = self._staged, self._staged_flights
        while self._next_staged < len(order):
            m_index = order[self._next_staged]
            flight = flights.get(m_index)
            if flight is None or not self._backends[m_index].advance(flight.handle):
                return
            self._next_staged += 1

    def finish(self) -> None:
        """Start what never became ready (zero gradients), wait for all, write results back."""
        lent = []
        missing = sorted(self._all_vars - self._ready)
        held = self._held
        try:
            nowhere = self._agree_on_kinds(held, missing) if held else frozenset()
            for var_index in missing:
                param = self._params[var_index]
                if not param.requires_grad:
                    if self._alone_in_its_messages(var_index):
                        continue  # frozen: never synchronized, never given a gradient
                    if param.grad is None:
                        lent.append(param)  # a fused message needs its piece on every rank; taken back below
                if param.grad is None:
                    # Another rank may have a gradient here (dynamic graphs): send zeros, as Horovod does.
                    param.grad = (_sparse_zeros(param) if var_index in self._sparse_vars else torch.zeros_like(param))
                self.mark_ready(var_index)
            if held:
                self._held = self._undecided_messages()
                for m_index in sorted(held):
                    if self._waiting_on[m_index] == 0 and not self._zeros_known(m_index, nowhere):
                        self._submit(m_index)  # (a frozen variable's own message: never ready)
            # One order on every rank where a route needs it (``_in_plan_order``): with staged messages the
            # order they start in, else plan order; otherwise the order of submission, so that results
            # are taken while later messages still travel.
            if self._in_plan_order:
                self._in_flight.sort(key=self._wait_position if self._staged else _plan_position)
            for flight in self._in_flight:
                stalls.where = ("step", self.instance, self._steps, flight.message.name)
                self._complete(flight)
            self._write_back_sparse()
            if self._staged and self._steps == 0:
                self._agree_on_order()
        finally:
            stalls.where = None
            self._steps += 1
            for param in lent:
                param.grad = None
            self._forget_step()

    def _wait_position(self, flight: _InFlight) -> int:
        return self._position[flight.index]

    def _agree_on_order(self) -> None:
        """After the first step: every rank adopts the order the first rank of the process set submitted
        this step's messages in (the order its backward pass made them ready), for starts and waits
        from the next step on; messages it did not submit keep reverse plan order, after the others.

        Reverse plan order is only a guess at the backward pass's: a model that declares its output
        layer first would have that layer's message, ready last, hold back every staged message
        after it, and no hierarchical byte would travel before the backward pass ends. One small
        all-gather per plan; a rank whose own order differs still overlaps most, and never
        mismatches: the order is the same on every rank.
        """
        stalls.where = ("step", self.instance, self._steps, None, "order")
        first = self._exchange(list(self._staged_flights), f"hybridsync.{self.namespace}.message_order")[0]
        count = len(self.plan.messages)
        order = list(dict.fromkeys(m for m in first if 0 <= m < count))
        taken = set(order)
        order += [m for m in reversed(range(count)) if m not in taken]
        self._position = {m: place for place, m in enumerate(order)}
        staged = set(self._staged)
        self._staged = [m for m in order if m in staged]

    def _agree_on_kinds(self, held: frozenset[int], missing: list[int]) -> frozenset[int]:
        """Every rank says, per undecided variable of ``held``, whether it has a dense, a sparse or no
        gradient; a variable sparse anywhere is sparse everywhere (zeros go sparse), one dense
        anywhere is dense. Dense on one rank and sparse on another: ``ValueError`` on every rank.

        Returns the variables no rank has a gradient for (``p.grad`` is ``None`` everywhere), whose
        sum is zeros (``_zeros_known``)."""
        undecided = sorted({v for m in held for v in self.plan.messages[m].var_indices} - self._kinds.decided)
        absent = set(missing)
        mine = [_NO_GRADIENT if self._params[v].grad is None else _UNTOUCHED if v in absent else
                _SPARSE if self._params[v].grad.is_sparse else _DENSE for v in undecided]
        stalls.where = ("step", self.instance, self._steps, None)  # None: this agreement
        everyone = self._exchange(mine, f"hybridsync.{self.namespace}.gradient_kinds")
        clashes = []
        for column, var_index in enumerate(undecided):
            kinds = [states[column] for states in everyone]
            if _SPARSE in kinds and _DENSE in kinds:
                clashes.append(f"{self.plan.var_names[var_index]} (sparse on ranks "
                               f"{[r for r, k in enumerate(kinds) if k == _SPARSE]}, dense on ranks "
                               f"{[r for r, k in enumerate(kinds) if k == _DENSE]})")
            elif _SPARSE in kinds or _DENSE in kinds:
                self._kinds.decided.add(var_index)
                if _SPARSE in kinds:
                    self._kinds.sparse.add(var_index)
        if clashes:
            raise ValueError(f"ranks disagree on which gradients are sparse: {'; '.join(clashes)} (ranks numbered "
                             f"within the optimizer's process set). Every rank must build the same model "
                             f"(nn.Embedding(sparse=...) alike).")
        return frozenset(var_index for column, var_index in enumerate(undecided)
                         if all(states[column] == _NO_GRADIENT for states in everyone))

    def _zeros_known(self, m_index: int, nowhere: frozenset[int]) -> bool:
        """A parameter-server message of variables no rank has a gradient for (``nowhere``), before their
        kind is known: not pushed, its sum being the zeros every rank holds. A key's first push fixes
        whether it is sparse, and these zeros would go dense: a sparse embedding that no rank looked up
        in the first step would have every later gradient refused. (The ring takes either kind.)"""
        return self._keyed[m_index] is not None and self.plan.messages[m_index].var_indices <= nowhere

    def _alone_in_its_messages(self, var_index: int) -> bool:
        return all(len(self.plan.messages[m].pieces) == 1 for m in self.plan.messages_of_var[var_index])

    def _submit(self, m_index: int) -> None:
        if self._as_rows[m_index] and self._submit_rows(m_index):
            return
        message = self.plan.messages[m_index]
        backend, compressor = self._backends[m_index], self._compressors[m_index]
        pieces = message.pieces
        if len(pieces) == 1 and pieces[0].whole:
            # The common case (no strategy: one variable per message), kept lean: it runs for
            # every parameter of every step, inside the backward pass.
            grad = self._gradient(pieces[0])
            if not grad.is_sparse:
                sent, ctx = compressor.compress(grad)
                handle = backend.submit(self._names[m_index], (sent,), self._reduction)
                flight = _InFlight(m_index, message, handle, None, [grad], [sent], [ctx], compressor)
                self._in_flight.append(flight)
                if self._staged:
                    self._staged_flights[m_index] = flight
                return
        grads = [self._gradient(piece) for piece in pieces]
        if any(grad.is_sparse for grad in grads):
            self._sparse_vars.update(p.var_index for p, g in zip(pieces, grads) if g.is_sparse)
            if not self._sparse_as_dense and self._submit_sparse(m_index, grads):
                return
            grads = [self._densify(piece.var_index, grad) if grad.is_sparse else grad
                     for piece, grad in zip(pieces, grads)]
        views = [self._piece_of(piece, grad) for piece, grad in zip(message.pieces, grads)]
        sent, contexts = zip(*(compressor.compress(view) for view in views))
        handle = backend.submit(self._names[m_index], sent, self._reduction)
        flight = _InFlight(m_index, message, handle, None, views, list(sent), list(contexts), compressor)
        self._in_flight.append(flight)
        if self._staged:
            self._staged_flights[m_index] = flight

    def _submit_rows(self, m_index: int) -> bool:
        """A message holding gradients sent as their nonzero rows: those as sparse gradients, the
        others as they are (a sparse one made dense under ``sparse_as_dense``). False: the backend
        cannot send sparse gradients (the strategy's validation keeps that from happening)."""
        grads = []
        for piece in self.plan.messages[m_index].pieces:
            if piece.rows:
                grads.append(self._nonzero_rows(piece.var_index))
                continue
            grad = self._gradient(piece)
            if grad.is_sparse:
                self._sparse_vars.add(piece.var_index)
                if self._sparse_as_dense:
                    grad = self._densify(piece.var_index, grad)
            grads.append(grad)
        return self._submit_sparse(m_index, grads)

    def _nonzero_rows(self, var_index: int) -> torch.Tensor:
        """The variable's dense gradient as a sparse tensor of its nonzero rows (made once per step)."""
        rows = self._rows.get(var_index)
        if rows is None:
            grad = self._params[var_index].grad
            # sparse already (a model whose description said dense): its rows are what it holds
            rows = self._rows[var_index] = grad.coalesce() if grad.is_sparse else nonzero_rows(grad)
        return rows

    def _submit_sparse(self, m_index: int, grads: list[torch.Tensor]) -> bool:
        """Send a message holding sparse gradients as sparse where its backend can; False: densify it."""
        message, compressor = self.plan.messages[m_index], self._compressors[m_index]
        pieces, sparse_backend, keyed_backend = message.pieces, self._sparse[m_index], self._keyed[m_index]
        if len(pieces) == 1 and pieces[0].whole and sparse_backend is not None:
            result = sparse_backend.submit_sparse(self._names[m_index], grads[0], self._reduction)
            self._in_flight.append(_InFlight(m_index, message, None, lambda: [result()], [], [], [], compressor,
                                             [(pieces[0].var_index, 0)]))
            return True
        if keyed_backend is None:
            return False
        parts, rows, views, sent, contexts = [], [], [], [], []
        for piece, grad in zip(pieces, grads):
            if grad.is_sparse:
                coalesced = grad if grad.is_coalesced() else self._coalesced(piece.var_index)
                parts.append((piece.var_name, _sparse_rows(coalesced, piece.start, piece.stop)))
                rows.append((piece.var_index, piece.start))
            else:  # a dense member of a merge group: its own key, compressed as the message says
                view = self._piece_of(piece, grad)
                wire, ctx = compressor.compress(view)
                parts.append((piece.var_name, wire))
                rows.append(None)
                views.append(view), sent.append(wire), contexts.append(ctx)
        result = keyed_backend.submit_parts(self._names[m_index], parts, self._reduction)
        self._in_flight.append(_InFlight(m_index, message, None, result, views, sent, contexts, compressor, rows))
        return True

    def _coalesced(self, var_index: int) -> torch.Tensor:
        """The variable's sparse gradient with unique, sorted rows (coalesced once per step)."""
        param = self._params[var_index]
        if not param.grad.is_coalesced():
            param.grad = param.grad.coalesce()
        return param.grad

    def _densify(self, var_index: int, grad: torch.Tensor) -> torch.Tensor:
        """A dense copy of a sparse gradient, shared by every message of the variable this step."""
        dense = self._densified.get(var_index)
        if dense is None:
            dense = self._densified[var_index] = grad.to_dense()
            if not self._sparse_as_dense:
                self.sent_dense.add(var_index)
        return dense

    def _write_back_sparse(self) -> None:
        """Every sparse gradient of the step from its reduced shards, or from its densified copy; a
        dense one sent as its nonzero rows from its reduced rows (shards), into its zeroed ``p.grad``."""
        for var_index, results in self._sparse_results.items():
            grad = self._params[var_index].grad
            grad.zero_()  # sparse tensors do not support set_(); a dense gradient adds sparse rows alike
            for result in results:
                grad.add_(result)
        for var_index, dense in self._densified.items():
            grad = self._params[var_index].grad
            grad.zero_().add_(dense.to_sparse(grad.sparse_dim()))

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
            for where, result in zip(flight.sparse_rows, flight.sparse_result()):
                if where is not None:
                    var_index, start = where
                    shape = self._params[var_index].shape
                    self._sparse_results.setdefault(var_index, []).append(_at_rows(result, start, shape))
        else:
            flight.handle.wait()
        for view, sent, ctx in zip(flight.views, flight.sent, flight.contexts):
            if sent is not view:
                view.copy_(flight.compressor.decompress(sent, ctx))


def _horovod_exchange(process_set: Any) -> KindsExchange:
    """The Horovod all-gather the ranks of ``process_set`` agree on gradient kinds through."""
    def exchange(states: list[int], name: str) -> list[list[int]]:
        from hybridsync.agreement import gather_records
        import horovod.torch as hvd
        return [record["kinds"] for record in gather_records(
            hvd, {"kinds": states}, process_set if process_set is not None else hvd.global_process_set, name)]
    return exchange


_plan_position = operator.attrgetter("index")


def _backend_key(message: Message) -> tuple[str, str]:
    """(route, variant): the all-reduce algorithm, or the parameter-server protocol."""
    return (message.config.route, message.config.variant)


def _sparse_rows(grad: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a coalesced sparse gradient, re-based to the shard: only touched rows."""
    indices, values = grad.indices(), grad.values()
    keep = (indices[0] >= start) & (indices[0] < stop)
    indices = indices[:, keep]
    indices[0] -= start  # boolean indexing copied them
    return torch.sparse_coo_tensor(indices, values[keep], (stop - start, *grad.shape[1:]),
                                   is_coalesced=True, check_invariants=False)


def _at_rows(shard: torch.Tensor, start: int, shape: torch.Size) -> torch.Tensor:
    """A reduced shard (sparse, rows re-based) placed back at row ``start`` of the whole variable."""
    if start == 0 and shard.shape == shape:
        return shard
    indices = shard._indices().clone()
    indices[0] += start
    return torch.sparse_coo_tensor(indices, shard._values(), shape, check_invariants=False)


def nonzero_rows(grad: torch.Tensor) -> torch.Tensor:
    """A dense gradient as a coalesced sparse tensor of its nonzero rows along dim 0 (a row is
    nonzero if any element is; NaN counts as nonzero), values a copy: what ``VarConfig.rows`` sends.
    Its dense form is ``grad`` again; with no nonzero row it holds none."""
    rows = nonzero_row_indices(grad)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), grad.index_select(0, rows), grad.shape,
                                   is_coalesced=True, check_invariants=False)


def _sparse_zeros(param: torch.Tensor) -> torch.Tensor:
    """An empty sparse gradient (no touched rows) for a parameter whose gradients are sparse."""
    return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64),
                                   torch.zeros((0, *param.shape[1:]), dtype=param.dtype), param.shape,
                                   check_invariants=False)
