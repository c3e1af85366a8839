"""A worker's links to the parameter servers: every call until it is answered, and recovery
when a server dies or hangs.

Every RPC a worker sends to a server is a ``Call``, kept until it is answered. When a
server is lost (its connection broke, or it left pings unanswered for the ping timeout) its
link goes *recovering*: calls to it wait, and a background thread (so a rank blocked in a
Horovod collective recovers too) waits for a replacement to join the group (``hybridsync-server
--supervise`` starts one; a hung server is first killed by its supervisor, on this worker's
verdict), sends it what this worker holds of its keys (``store.RestoreState``: the last BSP sum
and ASP/SSP pull of each), and sends every unanswered call again, with its step, to the new
server. Replays and deduplication on the server (``store.py``) make a resent push count
exactly once, so training goes on as if nothing happened. If nobody replaces the server, the
link fails and every wait raises ``PSServerError`` naming the server.

One loss brings others: a worker failed by a dead server leaves, and every other server then
quits because that worker stopped answering. Those later losses are *secondary*; the error
names the primary one, the server that died, even when a secondary loss reached this worker
first (it waits up to ``secondary_grace_s`` for a primary loss to show).
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Any, Protocol, Sequence

from torch.futures import Future

from hybridsync import envvars
from hybridsync.backends import stalls
from hybridsync.backends.peer_lost import PeerLostError
from hybridsync.backends.ps import group
from hybridsync.backends.ps.store import Pulled, RestoreState
from hybridsync.backends.ps.watchdog import SERVER_QUITS, PeerFailure

SUPERVISED_RECOVERY_TIMEOUT_S = 60.0
"""How long a worker waits for a supervised server's replacement (start-up on a busy host included)."""

_CONNECTION_LOST = ("eof", "econnrefused", "econnreset", "epipe", "pipe closed", "broken pipe",
                    "could not find destination", "connection reset")
"""Signs, in an RPC error's text, that the connection to the server broke (it died or was cut off)."""


QUIT_CAUSE = (" (the workers it names cannot be reached from it: their processes are gone or hang, or the "
              "network between their node and the server's is cut; their own errors, if any, say which)")
"""Ends a worker's error for a server that quit over workers that stopped answering it: on a cut
link, the workers on the server's side of the cut see only that quit, and must learn it means the
others are unreachable."""


class PSServerError(PeerLostError):
    """A parameter server died, hung, or refused a push; the message names the server."""


class Transport(Protocol):
    """What the links need from their client: the network, and where keys live."""

    config: Any

    def transport(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> Future: ...

    def server_of(self, key: str) -> int: ...

    def released_prefixes(self) -> tuple[str, ...]: ...


@dataclasses.dataclass(eq=False)
class Call:
    """One RPC to a server, resent to its replacement until answered."""

    server: int
    function: str
    args: tuple
    timeout: float
    future: Future = dataclasses.field(default_factory=Future)
    incarnation: int = -1
    """The server incarnation ``future`` was sent to (-1: held, not sent yet)."""


@dataclasses.dataclass
class Recovery:
    """One server replaced under this worker (``PSClient.recoveries``)."""

    server: int
    error: str
    """Why the old server was given up."""
    lost_at: float
    """``time.time()`` when this worker noticed."""
    incarnation: int = 0
    """The replacement's (1 for the first)."""
    recovered_at: float | None = None
    keys: int = 0
    """Keys this worker restored on the replacement."""
    resent: int = 0
    """Unanswered calls sent again."""

    @property
    def seconds(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.lost_at


@dataclasses.dataclass
class _Link:
    incarnation: int = 0
    state: str = "up"
    """``up``, ``recovering`` or ``failed``."""
    failure: str | None = None
    failed_at: float = 0.0
    """``time.monotonic()`` when it was given up (``failure`` reports the earliest)."""
    secondary: bool = False
    """Given up because the server quit over a worker that stopped answering (``SERVER_QUITS``)."""


class Links:
    """This worker's view of every server: current incarnation, calls in flight, what to restore."""

    def __init__(self, client: Transport, *, store: Any = None, secondary_grace_s: float = 3.0) -> None:
        """``secondary_grace_s``: how long a secondary loss waits for the primary one to show before
        it is reported (a dead server's connection fails at the next ping round)."""
        self._client = client
        self._secondary_grace_s = secondary_grace_s
        self._timeout_override = _recovery_timeout_from_env()
        self._store = store
        self._store_lock = threading.Lock()
        self._worker = client.config.index
        self._links = [_Link() for _ in range(client.config.num_servers)]
        self._cond = threading.Condition()
        self._inflight: set[Call] = set()
        self._rounds: dict[str, tuple[int, Any]] = {}
        self._pulls: dict[str, tuple[Pulled, int | None]] = {}
        self._staleness: dict[str, int | None] = {}
        self._schedules: dict[str, tuple[dict[str, Any], list, int]] = {}
        self.recoveries: list[Recovery] = []

    def attach_store(self, store: Any) -> None:
        """The rendezvous store, where replacements are counted and verdicts posted."""
        self._store = store

    def adopt_latest(self, index: int, store: Any) -> str:
        """Before any call: follow server ``index``'s newest incarnation (it may have been replaced
        before this worker joined); its RPC name."""
        latest = group.latest_incarnation(store, index)
        if latest > self._links[index].incarnation:
            self._links[index].incarnation = latest
        return self.name(index)

    # -- sending and waiting ---------------------------------------------------------------------
    def name(self, index: int) -> str:
        """Server ``index``'s RPC name (its current incarnation)."""
        return group.server_name(index, self._links[index].incarnation)

    def watched(self) -> list[str]:
        """The servers to ping: those up."""
        return [self.name(i) for i, link in enumerate(self._links) if link.state == "up"]

    def submit(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> Call:
        """Send ``function(*args)`` to server ``index`` now, or once its replacement is ready;
        ``PSServerError`` if a server is lost for good."""
        call = Call(index, function, args, timeout)
        with self._cond:
            self._raise_if_lost()  # under the same lock as the send: no link fails in between
            if function == "rpc_init_async":
                self._staleness[args[0]] = args[3]
            self._inflight.add(call)
            if self._links[index].state == "up":
                self._send(call)
        return call

    def _send(self, call: Call) -> None:
        """(Re)send ``call`` to its server's current incarnation (under ``_cond``)."""
        call.incarnation = self._links[call.server].incarnation
        call.future = self._client.transport(call.server, call.function, call.args, timeout=call.timeout)
        call.future.add_done_callback(lambda future, call=call: self._done(call, future))

    def _done(self, call: Call, future: Future) -> None:
        with self._cond:
            link = self._links[call.server]
            if future is not call.future or link.state != "up" or link.incarnation != call.incarnation:
                return  # an attempt given up on: the server it went to is being (or was) replaced
            error = _error(future)
            if error is None:
                self._record(call, future.value())
                self._inflight.discard(call)
            elif _quits(error):  # final: no supervisor replaces a server that quit over a worker
                self._fail(call.server, f"parameter server {group.server_name(call.server)} quit: "
                                        f"{_first_line(error)}{QUIT_CAUSE}", secondary=True)
            elif _connection_lost(error):
                self._lost(call.server, call.incarnation, _first_line(error), hung=False)
            else:
                self._inflight.discard(call)  # the server answered, with an error
            self._cond.notify_all()

    def _record(self, call: Call, result: Any) -> None:
        """Keep what a replacement of this call's server would need: the last sum, or pull, per key."""
        key = call.args[0]
        if call.function in ("rpc_push_pull", "rpc_push_pull_sparse"):
            self._rounds[key] = (call.args[2], result)
        elif call.function in ("rpc_push_delta", "rpc_init_async"):
            self._pulls[key] = (result, self._staleness.get(key))
        elif call.function == "rpc_sync_report":
            job, policy, _, step = call.args
            self._schedules[job] = (policy, result, step)

    def wait(self, calls: Sequence[Call], what: str) -> list[Any]:
        """Results of ``calls`` in order, across any recovery; ``PSServerError`` naming the server
        if one failed for good or refused a call."""
        with stalls.Watched() as watch:  # a rank out of step with the others is named, not waited for
            while True:
                with self._cond:
                    if self._answered(calls, what):
                        return [call.future.value() for call in calls]
                    self._cond.wait(0.1)
                watch.tick()

    def check(self) -> None:
        """``PSServerError`` if a server is lost for good (waiting out a secondary loss's grace)."""
        with self._cond:
            self._raise_if_lost()

    def _raise_if_lost(self) -> None:
        """``check`` under ``_cond``."""
        while (failure := self._verdict()) is None and self.failure() is not None:
            self._cond.wait(0.1)
        if failure is not None:
            raise PSServerError(failure)

    def _answered(self, calls: Sequence[Call], what: str) -> bool:
        """Whether every call is answered (under ``_cond``); ``PSServerError`` if one cannot be.

        Any server lost for good fails the wait, not only those of ``calls``: the others' rounds
        will not complete either once the other workers fail too."""
        failure = self._verdict()
        if failure is not None:
            raise PSServerError(failure)
        if not all(call.future.done() for call in calls):
            return False
        refused = [(call, error) for call in calls if (error := _error(call.future)) is not None
                   and not _connection_lost(error) and not _quits(error)
                   and call.incarnation == self._links[call.server].incarnation]
        if refused:
            call, error = refused[0]
            raise PSServerError(f"parameter server {group.server_name(call.server)} failed during "
                                f"{what}: {_first_line(error)}") from error
        return not any(_error(call.future) for call in calls)

    def failure(self) -> str | None:
        """Why a server was given up for good: a primary loss before a secondary one (a server that
        quit because a worker it served left), then the first in time (a server that died takes the
        other workers down, and the losses that follow must not hide it)."""
        with self._cond:  # links fail on the RPC threads (re-entrant: ``_raise_if_lost`` holds it)
            first = self._first_failed()
            return first.failure if first is not None else None

    def _first_failed(self) -> _Link | None:
        failed = [link for link in self._links if link.state == "failed"]
        return min(failed, key=lambda link: (link.secondary, link.failed_at)) if failed else None

    def _verdict(self) -> str | None:
        """``failure()`` once it is final: a secondary loss only after ``secondary_grace_s``, in case
        the primary loss it followed from shows meanwhile (under ``_cond``)."""
        first = self._first_failed()
        if first is None or first.secondary and time.monotonic() - first.failed_at < self._secondary_grace_s:
            return None
        return first.failure

    def forget_prefix(self, prefix: str) -> None:
        """A released namespace: nothing of it is restored any more."""
        with self._cond:
            for records in (self._rounds, self._pulls, self._staleness):
                for key in [k for k in records if k.startswith(prefix)]:
                    del records[key]

    # -- losing a server and recovering it -------------------------------------------------------
    def on_watchdog(self, failures: list[PeerFailure]) -> None:
        """The watchdog's report: servers that failed a ping."""
        with self._cond:
            for failure in failures:
                index, incarnation = _parse_server(failure.peer)
                self._lost(index, incarnation, failure.error, hung=failure.hung)
            self._cond.notify_all()

    def _lost(self, index: int, incarnation: int, error: str, *, hung: bool) -> None:
        """Server ``index`` (``incarnation``) is unusable: start recovering it, once (under ``_cond``)."""
        link = self._links[index]
        if link.state != "up" or link.incarnation != incarnation:
            return
        link.state = "recovering"
        record = Recovery(server=index, error=error, lost_at=time.time())
        threading.Thread(target=self._recover, args=(index, incarnation, record, hung),
                         name=f"hybridsync-ps-recover-{index}", daemon=True).start()

    def _recover(self, index: int, incarnation: int, record: Recovery, hung: bool) -> None:
        who = f"parameter server {group.server_name(index)}"
        what = "stopped answering" if hung else "is gone"
        timeout = self._recovery_timeout(index)
        if timeout <= 0:
            self._fail(index, f"{who} is unreachable ({record.error}); it died, hung, or exited because another "
                              f"worker died (see its log). Nothing replaces it: start servers with "
                              f"`hybridsync-server --supervise` (hybridsync-run does), or set "
                              f"{envvars.PS_RECOVERY_TIMEOUT} if your launcher restarts them")
            return
        _log(self._worker, f"{who} {what} ({record.error}); waiting up to {timeout:.0f} s for its replacement")
        if hung:
            self._store_op(lambda s: s.set(group.store_key(f"server{index}", "hung"), str(incarnation)))
        deadline = time.monotonic() + timeout
        while True:
            new = self._wait_replacement(index, incarnation, deadline)
            if isinstance(new, str):
                self._fail(index, f"{who} {what} ({record.error}) and {new}")
                return
            with self._cond:
                self._links[index].incarnation = new
                state = self._restore_state(index)
            try:
                remaining = max(10.0, deadline - time.monotonic())
                self._client.transport(index, "rpc_restore", (self._worker, state), timeout=remaining).wait()
                break
            except Exception as e:  # noqa: BLE001 - the replacement died too: again, with it or the next one
                if time.monotonic() > deadline or not _connection_lost(e):
                    self._fail(index, f"{who}'s replacement failed while restoring its keys: {_first_line(e)}")
                    return
                time.sleep(0.5)
        with self._cond:
            self._links[index].state = "up"
            resend = [call for call in self._inflight if call.server == index]
            for call in resend:
                self._send(call)
            record.incarnation, record.keys, record.resent = new, len(state.rounds) + len(state.parameters), len(resend)
            record.recovered_at = time.time()
            self.recoveries.append(record)
            self._cond.notify_all()
        _log(self._worker, f"{who} replaced (incarnation {new}): recovered in {record.seconds:.1f} s "
                           f"({record.keys} keys restored, {record.resent} pushes resent)")

    def _recovery_timeout(self, index: int) -> float:
        """``HYBRIDSYNC_PS_RECOVERY_TIMEOUT`` if set; else 60 s for a supervised server, 0 otherwise."""
        if self._timeout_override is not None:
            return self._timeout_override
        supervised = self._store_op(lambda s: s.check([group.store_key(f"server{index}", "supervised")]))
        return SUPERVISED_RECOVERY_TIMEOUT_S if supervised else 0.0

    def _wait_replacement(self, index: int, incarnation: int, deadline: float) -> int | str:
        """The incarnation that replaced ``incarnation`` once it joined the group, or why none will."""
        given_up = group.store_key(f"server{index}", "given_up")
        started = time.monotonic()
        while time.monotonic() < deadline:
            latest = self._store_op(lambda s: group.latest_incarnation(s, index))
            if latest is None:
                return f"the rendezvous store at {self._client.config.init_method} is gone (the job is ending)"
            if latest > incarnation and self._store_op(lambda s: group.joined(s, group.server_name(index, latest))):
                return latest
            why = self._store_op(lambda s: s.get(given_up).decode() if s.check([given_up]) else "")
            if why:
                return f"its supervisor gave up: {why}"
            time.sleep(0.1)
        return f"no replacement joined within {deadline - started:.0f} s"

    def _restore_state(self, index: int) -> RestoreState:
        """What this worker holds of server ``index``'s keys (under ``_cond``)."""
        on = self._client.server_of
        return RestoreState(released=self._client.released_prefixes(),
                            rounds={k: v for k, v in self._rounds.items() if on(k) == index},
                            parameters={k: v for k, v in self._pulls.items() if on(k) == index},
                            schedules=dict(self._schedules) if index == 0 else {})

    def _store_op(self, operation: Any) -> Any:
        """``operation(store)``, or None when there is no store or it cannot be reached."""
        if self._store is None:
            return None
        with self._store_lock:
            try:
                return operation(self._store)
            except Exception:  # noqa: BLE001 - an unreachable store means no replacement can join
                return None

    def _fail(self, index: int, message: str, *, secondary: bool = False) -> None:
        with self._cond:
            link = self._links[index]
            if link.state == "failed":
                return
            link.state, link.failure, link.failed_at, link.secondary = "failed", message, time.monotonic(), secondary
            self._cond.notify_all()
        _log(self._worker, message)


def _recovery_timeout_from_env() -> float | None:
    return envvars.seconds_from_env(envvars.PS_RECOVERY_TIMEOUT, None)


def _parse_server(name: str) -> tuple[int, int]:
    """``server3:2`` -> (3, 2); ``server3`` -> (3, 0)."""
    base, _, incarnation = name.partition(":")
    return int(base.removeprefix("server")), int(incarnation or 0)


def _error(future: Future) -> BaseException | None:
    try:
        future.value()
        return None
    except Exception as e:  # noqa: BLE001 - RPC errors come in several types
        return e


def _quits(error: BaseException) -> bool:
    """Whether ``error`` is a server's word that it quits over a worker that stopped answering."""
    return SERVER_QUITS in str(error)


def _connection_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return any(sign in text for sign in _CONNECTION_LOST)


def _first_line(error: BaseException) -> str:
    """The useful line of an RPC error (torch wraps remote callback errors in a prefix)."""
    text = str(error).strip()
    text = text.split("Got the following error when running the callback: ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


def _log(worker: int, message: str) -> None:
    print(f"hybridsync PS worker{worker}: {message}", file=sys.stderr, flush=True)
