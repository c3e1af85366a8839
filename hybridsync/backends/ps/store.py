"""What a server holds per key, and the BSP rule that answers pulls.

BSP: each key runs in rounds. A round collects one push from every worker; when the last
one arrives the server sums them (in worker order, so the result does not depend on
arrival order) and completes every worker's pending pull with the sum. A worker cannot
push round ``t + 1`` of a key before its pull of round ``t`` returned, so one open round
per key is enough; the step number a worker sends is checked to catch plan mismatches.

Dense payloads are tensors; sparse payloads are ``(indices, values, size)`` of a COO
tensor, and the result covers the union of the rows the workers touched. A key's first
push fixes its kind (dense or sparse, dtype, shape); every later push is checked against
it, and a push that does not match (another plan's payload, a corrupt one) is answered
with an error naming the key and both kinds, never summed.

ASP/SSP (``AsyncKey``): the server holds the parameter itself. A worker pushes the delta of
its local optimizer step; the server adds it and answers with the current parameter. ASP
answers at once; SSP holds the answer while the pusher is more than ``staleness`` pushes
ahead of the slowest worker still attached, so no worker runs further ahead than that.

Recovery: a server started in place of a dead one (``hybridsync-server --supervise``) gets
its keys back from the workers (``KeyStore.restore``). A BSP key learns the last round any
worker completed and that round's sum, which it answers again to a worker whose answer was
lost (a *replay*); every other worker's pending push is sent again. An ASP/SSP key takes the
freshest value any worker pulled (answers carry the per-worker push counts they include), and
a push that value already includes is answered without being applied again.

Release: keys live until the workers release their prefix (a router's namespace, when
its plan is replaced or its optimizer closed). A worker releases once it is done with
them; the keys go once every worker has released them or left, so a slower worker's last
pushes of a replaced plan are still answered. The prefix is never reused afterwards.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Collection, Iterable, NamedTuple

import torch
from torch.futures import Future

SparsePayload = tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]


class Pulled(NamedTuple):
    """An ASP/SSP answer: the parameter, and how many pushes of each worker it includes."""

    value: torch.Tensor
    clocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreState:
    """What one worker holds of a replaced server's keys: enough to rebuild them."""

    released: tuple[str, ...] = ()
    """Key prefixes this worker released."""
    rounds: dict[str, tuple[int, Any]] = dataclasses.field(default_factory=dict)
    """BSP key -> (the last step whose sum this worker received, that sum)."""
    parameters: dict[str, tuple[Pulled, int | None]] = dataclasses.field(default_factory=dict)
    """ASP/SSP key -> (this worker's last pull, the key's staleness)."""
    schedules: dict[str, tuple[dict[str, Any], list, int]] = dataclasses.field(default_factory=dict)
    """Server 0 only: Sync-Switch job -> (its policy, the last schedule received, after which step)."""


@dataclasses.dataclass(kw_only=True)
class WireCounters:
    """Payload bytes moved (tensor data only; RPC framing and pickled headers excluded)."""

    pushed_bytes: int = 0
    pulled_bytes: int = 0
    push_pulls: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def payload_bytes(payload: torch.Tensor | SparsePayload) -> int:
    """Bytes of tensor data in a dense or sparse payload."""
    if isinstance(payload, torch.Tensor):
        return payload.nbytes
    if isinstance(payload, Pulled):
        return payload.value.nbytes
    indices, values, _ = payload
    return indices.nbytes + values.nbytes


@dataclasses.dataclass(frozen=True)
class PayloadKind:
    """What a key holds: dense or sparse, element type, and the (full, for sparse) shape."""

    sparse: bool
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{'sparse' if self.sparse else 'dense'} {str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


def payload_kind(payload: Any) -> PayloadKind:
    """The kind of a dense or sparse payload; ``ValueError`` saying why for anything malformed."""
    if isinstance(payload, torch.Tensor):
        if payload.layout != torch.strided:
            raise ValueError(f"a {payload.layout} tensor (sparse pushes are (indices, values, size))")
        return PayloadKind(False, payload.dtype, tuple(payload.shape))
    if not (isinstance(payload, tuple) and len(payload) == 3 and isinstance(payload[0], torch.Tensor)
            and isinstance(payload[1], torch.Tensor)):
        raise ValueError(f"a {type(payload).__name__}, neither a tensor nor (indices, values, size)")
    indices, values, size = payload
    try:
        size = tuple(int(d) for d in size)
    except (TypeError, ValueError):
        raise ValueError(f"sparse size {size!r} is not a sequence of integers") from None
    if indices.dim() != 2 or indices.dtype != torch.int64 or not 1 <= indices.shape[0] <= len(size):
        raise ValueError(f"sparse indices of shape {list(indices.shape)} and dtype {indices.dtype} for size {size}")
    if values.shape[0] != indices.shape[1] or tuple(values.shape[1:]) != size[indices.shape[0]:]:
        raise ValueError(f"sparse values of shape {list(values.shape)} for {indices.shape[1]} indices of size {size}")
    if indices.numel() and (int(indices.min()) < 0 or any(
            int(indices[d].max()) >= size[d] for d in range(indices.shape[0]))):
        raise ValueError(f"sparse indices outside size {size}")
    return PayloadKind(True, values.dtype, size)


def sum_dense(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the workers' tensors; half types are accumulated in float32."""
    low_precision = parts[0].dtype in (torch.float16, torch.bfloat16)
    total = parts[0].to(torch.float32) if low_precision else parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total.to(parts[0].dtype) if low_precision else total


def sum_sparse(parts: list[SparsePayload]) -> SparsePayload:
    """Sum of sparse payloads over the union of their rows (duplicate rows added)."""
    size = parts[0][2]
    for _, _, other in parts[1:]:
        if tuple(other) != tuple(size):
            raise ValueError(f"workers pushed sparse tensors of different sizes: {tuple(size)} and {tuple(other)}")
    indices = torch.cat([p[0] for p in parts], dim=1)
    values = torch.cat([p[1] for p in parts], dim=0)
    total = torch.sparse_coo_tensor(indices, values, size, check_invariants=False).coalesce()
    return total.indices(), total.values(), tuple(size)


class BspKey:
    """The open round of one key."""

    def __init__(self, key: str, kind: PayloadKind, num_workers: int, combine: Callable[[list[Any]], Any]) -> None:
        self.key = key
        self.kind = kind
        self.num_workers = num_workers
        self.combine = combine
        self.step = 0
        self.lock = threading.Lock()
        self._parts: dict[int, Any] = {}
        self._futures: list[Future] = []
        self._last: tuple[int, Any] | None = None
        """After a restore: the last round's step and sum, replayed to a worker whose answer was lost."""

    def push(self, worker: int, step: int, payload: Any, gone: Collection[int] = ()) -> tuple[
            Future, Callable[[], None] | None]:
        """Record ``worker``'s push; returns its pull future and, for the last push, the closer.
        ``gone``: workers that said goodbye, whose pushes will never come."""
        future: Future = Future()
        with self.lock:
            if self._last is not None and step == self._last[0] == self.step - 1:
                future.set_result(self._last[1])  # a replay: this round's sum came from a worker's restore
                return future, None
            problem = self._problem(worker, step) or (self._left_problem(gone, [worker]) if gone else None)
            if problem is not None:
                future.set_exception(ValueError(problem))
                return future, None
            self._parts[worker] = payload
            self._futures.append(future)
            if len(self._parts) < self.num_workers:
                return future, None
            parts = [self._parts[w] for w in sorted(self._parts)]
            futures, self._parts, self._futures = self._futures, {}, []
            self.step += 1
            self._last = None  # every worker pushed this round, so each has the previous one's sum
        return future, lambda: _complete(futures, self.combine, parts)

    def restore(self, step: int, result: Any) -> None:
        """A worker received the sum of round ``step`` (``result``) from the dead server: adopt it."""
        with self.lock:
            if step < self.step - 1 or (step == self.step - 1 and self._last is not None):
                return  # older than what this key knows
            if step >= self.step and self._parts and self.step != step:
                raise AssertionError(f"key {self.key!r}: workers at step {self.step} and past step {step}")
            futures = self._futures if step >= self.step else []
            if step >= self.step:
                self._parts, self._futures = {}, []
            self.step, self._last = step + 1, (step, result)
        for future in futures:  # pushes of that round from workers whose answer was lost
            future.set_result(result)

    def _problem(self, worker: int, step: int) -> str | None:
        if step != self.step:
            return (f"worker{worker} pushed step {step} of key {self.key!r} but the server is at step "
                    f"{self.step}; workers must synchronize the same messages in the same steps")
        if worker in self._parts:
            return f"worker{worker} pushed key {self.key!r} twice in step {step}"
        return None

    def _left_problem(self, gone: Collection[int], waiting: Iterable[int]) -> str:
        workers = ", ".join(f"worker{w}" for w in sorted(gone))
        return (f"{workers} left the job (its script ended or raised: read its output) while "
                f"{', '.join(f'worker{w}' for w in sorted(waiting))} waited for its push in step {self.step} "
                f"of key {self.key!r}; if it raised nothing, the ranks ran different numbers of steps: "
                f"every rank must call step() (or synchronize()) as often as the others")

    def worker_left(self, gone: Collection[int]) -> None:
        """Workers in ``gone`` said goodbye: fail an open round, which their pushes can no longer
        complete (a worker leaves only once its own pushes were answered, so they are not in it)."""
        with self.lock:
            waiting = sorted(self._parts)
        if waiting:
            self.fail(self._left_problem(gone, waiting))

    def fail(self, message: str) -> None:
        """Fail every pull waiting on this key (the server is going away, or the round cannot complete)."""
        with self.lock:
            futures, self._futures, self._parts = self._futures, [], {}
        for future in futures:
            future.set_exception(RuntimeError(message))


def _complete(futures: list[Future], combine: Callable[[list[Any]], Any], parts: list[Any]) -> None:
    """Combine outside the key's lock and answer every worker (errors are answered too)."""
    try:
        result = combine(parts)
    except Exception as e:  # noqa: BLE001 - forwarded to every worker's pull
        for future in futures:
            future.set_exception(e)
        return
    for future in futures:
        future.set_result(result)


@dataclasses.dataclass(kw_only=True)
class StalenessCounters:
    """What the SSP bound did: answers held back, and the largest lead any answer was given at."""

    delayed: int = 0
    max_lead_answered: int = 0
    """Max over answers of (pusher's clock - slowest clock) when answered; <= staleness under SSP."""


class AsyncKey:
    """A parameter held by the server under ASP (``staleness=None``) or SSP."""

    def __init__(self, key: str, value: torch.Tensor, num_workers: int, staleness: int | None,
                 counters: StalenessCounters) -> None:
        self.key, self.value, self.staleness, self.counters = key, value.clone(), staleness, counters
        self.kind = PayloadKind(False, value.dtype, tuple(value.shape))
        self.clocks = [0] * num_workers
        self.attached = set(range(num_workers))
        self.lock = threading.Lock()
        self.restored = False
        """Rebuilt from the workers' pulls: a push the value already includes is answered, not applied."""
        self._held: list[tuple[int, Future]] = []

    def offer(self, pulled: Pulled) -> None:
        """A worker's last pull from the dead server: kept if it includes more pushes than the value held."""
        with self.lock:
            self.restored = True
            if sum(pulled.clocks) > sum(self.clocks):
                self.value.copy_(pulled.value.view_as(self.value))
                self.clocks = list(pulled.clocks)

    def snapshot(self) -> Pulled:
        """The current value and what it includes (a copy)."""
        with self.lock:
            return Pulled(self.value.clone(), tuple(self.clocks))

    def push(self, worker: int, clock: int, delta: torch.Tensor) -> Future:
        """Apply ``delta``; the future resolves to the parameter once the SSP bound allows."""
        future: Future = Future()
        with self.lock:
            if clock < self.clocks[worker] and self.restored:
                future.set_result(Pulled(self.value.clone(), tuple(self.clocks)))  # applied before the server died
                return future
            if clock != self.clocks[worker]:
                future.set_exception(ValueError(f"worker{worker} pushed clock {clock} of key {self.key!r}, "
                                                f"expected {self.clocks[worker]}"))
                return future
            self.value.add_(delta.view_as(self.value))
            self.clocks[worker] += 1
            self._held.append((worker, future))
            answers = self._release()
            if all(answered is not future for answered, _ in answers):
                self.counters.delayed += 1
        _answer(answers)
        return future

    def detach(self, worker: int) -> None:
        """``worker`` left: it no longer holds the others back."""
        with self.lock:
            self.attached.discard(worker)
            answers = self._release()
        _answer(answers)

    def _release(self) -> list[tuple[Future, Pulled]]:
        """Answers now allowed (called under the lock), each with a snapshot of the value."""
        slowest = min((self.clocks[w] for w in self.attached), default=max(self.clocks))
        ready = [(w, f) for w, f in self._held
                 if self.staleness is None or self.clocks[w] - slowest <= self.staleness]
        if not ready:
            return []
        released = {id(f) for _, f in ready}
        self._held = [(w, f) for w, f in self._held if id(f) not in released]
        for w, _ in ready:
            self.counters.max_lead_answered = max(self.counters.max_lead_answered, self.clocks[w] - slowest)
        snapshot = Pulled(self.value.clone(), tuple(self.clocks))
        return [(f, snapshot) for _, f in ready]


def _answer(answers: list[tuple[Future, Pulled]]) -> None:
    for future, value in answers:
        future.set_result(value)


def _refused(message: str) -> Future:
    """A push's answer that fails with ``message`` on the worker (the key's state is left untouched).

    ``Future.set_exception`` alone stores the exception as the future's value (only Python's
    ``wait()`` raises it), so RPC would send it back as a normal result; a ``then`` callback
    that raises marks the future as failed, which RPC carries to the caller as an error.
    """
    future: Future = Future()
    future.set_exception(ValueError(message))
    return future.then(lambda failed: failed.wait())


def _mismatch(key: str, held: PayloadKind, worker: int | None, pushed: PayloadKind) -> str:
    who = "a worker" if worker is None else f"worker{worker}"
    return (f"{who} pushed {pushed} to key {key!r}, which holds {held}; a key's first push fixes its kind "
            f"(do two optimizers or routing plans share key names?)")


class KeyStore:
    """Every key a server holds, with byte counters."""

    def __init__(self, *, num_workers: int) -> None:
        self.num_workers = num_workers
        self.counters = WireCounters()
        self.staleness_counters: dict[str, StalenessCounters] = {}
        """Per mode: ``asp`` or ``ssp<k>``; keys of one mode share counters."""
        self._keys: dict[str, BspKey] = {}
        self._async_keys: dict[str, AsyncKey] = {}
        self._releases: dict[str, set[int]] = {}
        """Per released prefix, the workers that released it so far (until its keys are dropped)."""
        self._gone: set[int] = set()
        """Workers that said goodbye: they count as having released every prefix."""
        self._lock = threading.Lock()

    def key_names(self) -> list[str]:
        """Every key this store holds, BSP and ASP/SSP, sorted."""
        with self._lock:
            return sorted([*self._keys, *self._async_keys])

    def release(self, prefix: str, worker: int) -> int:
        """``worker`` is done with every key starting with ``prefix``; once all workers are (or
        left), those keys are dropped. Returns how many keys were dropped by this call."""
        if not prefix:
            raise ValueError("a release needs a non-empty key prefix (a router's namespace)")
        with self._lock:
            released = self._releases.setdefault(prefix, set())
            released.add(worker)
            async_states = [state for key, state in self._async_keys.items() if key.startswith(prefix)]
            done = len(released | self._gone) >= self.num_workers
            dropped: list[Any] = []
            if done:
                del self._releases[prefix]
                for keys in (self._keys, self._async_keys):
                    for key in [k for k in keys if k.startswith(prefix)]:
                        dropped.append(keys.pop(key))
        for state in async_states:
            state.detach(worker)  # it pushes these keys no more: it must not hold SSP answers back
        for state in dropped:
            if isinstance(state, BspKey):
                state.fail(f"key {state.key!r} was released by every worker with an open round")
        return len(dropped)

    def init_async(self, key: str, value: torch.Tensor, staleness: int | None) -> Pulled:
        """Create an ASP/SSP key (the first worker's value wins); returns the current value."""
        kind = payload_kind(value)
        if kind.sparse:
            raise ValueError(f"key {key!r}: an ASP/SSP parameter must be a dense tensor, got {kind}")
        with self._lock:
            if key in self._keys:
                raise ValueError(f"key {key!r} holds BSP {self._keys[key].kind} gradients; it cannot also "
                                 f"hold an ASP/SSP parameter")
            state = self._async_keys.get(key)
            if state is not None and state.kind != kind:
                raise ValueError(_mismatch(key, state.kind, None, kind))
            if state is None:
                mode = "asp" if staleness is None else f"ssp{staleness}"
                counters = self.staleness_counters.setdefault(mode, StalenessCounters())
                state = self._async_keys[key] = AsyncKey(key, value, self.num_workers, staleness, counters)
            elif state.staleness != staleness:
                raise ValueError(f"workers disagree on the staleness of key {key!r}: "
                                 f"{state.staleness} and {staleness}")
        return state.snapshot()

    def restore(self, worker: int, state: RestoreState, *, parameters: bool = True) -> int:
        """Rebuild keys from what ``worker`` holds of a dead server's (``RestoreState``); returns how many.

        ``parameters=False``: ASP/SSP values are only created where missing, never replaced
        (pushes may already have been applied to them)."""
        for prefix in state.released:
            self.release(prefix, worker)
        for key, (step, result) in state.rounds.items():
            with self._lock:
                held = self._keys.get(key)
                if held is None:
                    kind = payload_kind(result)
                    held = self._keys[key] = BspKey(key, kind, self.num_workers, sum_sparse if kind.sparse else sum_dense)
            held.restore(step, result)
        for key, (pulled, staleness) in state.parameters.items():
            with self._lock:
                created = key not in self._async_keys
            self.init_async(key, pulled.value, staleness)
            if parameters or created:
                self._async_keys[key].offer(pulled)
        return len(state.rounds) + len(state.parameters)

    def push_delta(self, key: str, worker: int, clock: int, delta: torch.Tensor) -> Future:
        """ASP/SSP push of a parameter delta; resolves to the server's current parameter."""
        try:
            kind = payload_kind(delta)
        except ValueError as e:
            return _refused(f"worker{worker} pushed a malformed delta to key {key!r}: {e}")
        with self._lock:
            state = self._async_keys.get(key)
            if state is None:
                held = f"holds BSP {self._keys[key].kind} gradients" if key in self._keys else "was never initialized"
                return _refused(f"worker{worker} pushed an ASP/SSP delta to key {key!r}, which {held}")
            if kind != state.kind:
                return _refused(_mismatch(key, state.kind, worker, kind))
            self.counters.pushed_bytes += delta.nbytes
            self.counters.push_pulls += 1
        return state.push(worker, clock, delta).then(self._count_pull)

    def detach(self, worker: int) -> None:
        """``worker`` said goodbye: release SSP answers it was holding back."""
        with self._lock:
            self._gone.add(worker)
            gone = frozenset(self._gone)
            states = list(self._async_keys.values())
            rounds = list(self._keys.values())
        for state in states:
            state.detach(worker)
        for round_ in rounds:
            round_.worker_left(gone)

    def push_pull(self, key: str, worker: int, step: int, payload: torch.Tensor | SparsePayload) -> Future:
        """BSP push of ``payload``; the future resolves to the sum over all workers.

        The key's first push fixes its kind; a push of another kind is refused (the error
        names the key and both kinds) and leaves the key's round untouched.
        """
        try:
            kind = payload_kind(payload)
        except ValueError as e:
            return _refused(f"worker{worker} pushed a malformed payload to key {key!r}: {e}")
        with self._lock:
            if key in self._async_keys:
                return _refused(f"worker{worker} pushed a BSP {kind} payload to key {key!r}, which holds an "
                                f"ASP/SSP parameter ({self._async_keys[key].kind})")
            state = self._keys.get(key)
            if state is None:
                state = self._keys[key] = BspKey(key, kind, self.num_workers,
                                                 sum_sparse if kind.sparse else sum_dense)
            elif state.kind != kind:
                return _refused(_mismatch(key, state.kind, worker, kind))
            self.counters.pushed_bytes += payload_bytes(payload)
            self.counters.push_pulls += 1
            gone = frozenset(self._gone)
        future, close = state.push(worker, step, payload, gone)
        if close is not None:
            close()
        return future.then(self._count_pull)

    def _count_pull(self, future: Future) -> Any:
        result = future.wait()
        with self._lock:
            self.counters.pulled_bytes += payload_bytes(result)
        return result

    def fail_all(self, message: str) -> None:
        """Fail every pending pull, e.g. when the server exits because a worker died."""
        with self._lock:
            states = list(self._keys.values())
        for state in states:
            state.fail(message)
