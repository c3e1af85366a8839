"""Whether the other members of a hierarchical group can still be reached, while a step waits for them.

The hierarchical route's Gloo groups (``groups.py``) bound a collective only by Gloo's own
timeout, ``GROUP_TIMEOUT`` (600 s): a peer that is merely busy (rank 0 writing a checkpoint
while the others went on into the next step) must not fail the job, and Gloo cannot tell a
busy peer from one the network cut off. Measured on the emulated 2 x 2 cluster with the link
between the nodes cut mid-training (benchmarks/netfault.py): every rank of a hierarchical job
waited past 90 s without a word, where Horovod's ring failed after its 30 s Gloo timeout.

So every process that builds groups opens a *beacon*: a listening socket that a daemon thread
accepts on, answering one byte. The kernel completes a connection to it whether the process is
computing, waiting or stopped, so a probe that connects tells reachability apart: it connects to
a live peer; it is refused by a host whose process is gone; it gets no answer when the network
between the hosts is cut (or the host is dead). The byte tells a live peer from a hung one (its
process stopped, SIGSTOP, or deadlocked: its host answers, it does not): the beacon's thread
answers while the peer computes, waits or writes a checkpoint (Python hands it the GIL every few
milliseconds, and torch's kernels and file writes release it). A step that has waited
``PROBE_AFTER_S`` for a group's collective probes the group's other members every
``PROBE_EVERY_S``, and raises ``PeerUnreachableError`` naming the rank, its address and the
route once a peer refused, stayed unreachable for ``HYBRIDSYNC_PEER_TIMEOUT`` seconds (default
``DEFAULT_UNREACHABLE_S``: an outage shorter than that, a link that flaps, is ridden out as TCP
rides it out), or connected without its byte for ``HYBRIDSYNC_PEER_HUNG_TIMEOUT`` seconds
(default: Horovod's own Gloo timeout, ``HOROVOD_GLOO_TIMEOUT_SECONDS``, 30 s, after which plain
Horovod gives up on a stopped rank too). When Gloo itself fails a collective (a peer's
connection reset: its node was killed), the error names the members whose beacons no longer
answer, where Gloo's names only an address and port.
"""
from __future__ import annotations

import dataclasses
import errno
import socket
import threading
import time

from hybridsync import envvars
from hybridsync.backends.peer_lost import PeerLostError

PROBE_AFTER_S = 2.0
"""A collective that has waited this long starts probing its peers (a healthy one ends sooner)."""
PROBE_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 1.0
"""One probe's bound: on a cut link the connection attempt gets no answer at all."""
DEFAULT_UNREACHABLE_S = 10.0
"""A peer unanswering this long is given up (``HYBRIDSYNC_PEER_TIMEOUT``): the PS watchdog's ping
timeout, and a third of Horovod's own Gloo timeout (30 s)."""
HOROVOD_GLOO_TIMEOUT_S = 30.0
"""Horovod's own bound on a Gloo operation when ``HOROVOD_GLOO_TIMEOUT_SECONDS`` is unset."""
ANSWER = b"!"
"""What a beacon's thread sends on every connection it accepts."""


class PeerUnreachableError(PeerLostError):
    """A member of a hierarchical group cannot be reached: its process is gone or the network is cut."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where another member's beacon listens."""

    rank: int
    node: int
    host: str
    port: int


class Beacon:
    """This process's listening socket, whose daemon thread answers ``ANSWER`` to every connection (one per process)."""

    def __init__(self, address: str) -> None:
        # A hung process accepts nothing: its kernel queues every probe's connection, and a full
        # queue would make a hung peer look cut off. SOMAXCONN lasts over an hour of probes.
        self._socket = socket.create_server((address, 0), backlog=socket.SOMAXCONN)
        self.host, self.port = self._socket.getsockname()[:2]
        threading.Thread(target=self._answer, name="hybridsync-beacon", daemon=True).start()

    def _answer(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            with connection:
                try:
                    connection.sendall(ANSWER)
                except OSError:
                    pass  # the prober gave up already


_beacon: Beacon | None = None


def beacon(address: str) -> Beacon:
    """This process's beacon, opened on ``address`` at the first call (the process keeps it)."""
    global _beacon
    if _beacon is None:
        _beacon = Beacon(address)
    return _beacon


def unreachable_seconds() -> float:
    """``HYBRIDSYNC_PEER_TIMEOUT`` (default ``DEFAULT_UNREACHABLE_S``)."""
    return envvars.seconds_from_env(envvars.PEER_TIMEOUT, DEFAULT_UNREACHABLE_S)


def hung_seconds() -> float:
    """``HYBRIDSYNC_PEER_HUNG_TIMEOUT`` (default ``HOROVOD_GLOO_TIMEOUT_SECONDS``, else 30 s)."""
    return envvars.seconds_from_env(envvars.PEER_HUNG_TIMEOUT,
                                    envvars.seconds_from_env(envvars.HOROVOD_GLOO_TIMEOUT, HOROVOD_GLOO_TIMEOUT_S))


def probe(peer: Peer) -> str | None:
    """``None`` if ``peer``'s beacon answers its byte; ``"refused"`` if its host refuses (the process
    is gone), ``"no answer"`` if the connection gets no answer (the network is cut or the host is
    down), ``"silent"`` if it connects but the byte does not come (the process hangs)."""
    try:
        connection = socket.create_connection((peer.host, peer.port), timeout=CONNECT_TIMEOUT_S)
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return "refused" if e.errno == errno.ECONNREFUSED else "no answer"
    with connection:
        try:
            return None if connection.recv(1) == ANSWER else "silent"
        except ConnectionResetError:
            return "refused"
        except OSError:  # the byte did not come within CONNECT_TIMEOUT_S
            return "silent"


class PeerWatch:
    """Probes one group's other members while one of its collectives is outstanding."""

    def __init__(self, peers: list[Peer], label: str) -> None:
        """``label``: the group, as errors name it (``hierarchical all-reduce across nodes``)."""
        self._peers, self._label = peers, label
        self._unanswered: dict[tuple[int, str], float] = {}
        """Since when each (peer, outcome) has been the case, in the wait of ``self._wait``: an
        unreachable peer and a silent one are given up after different times."""
        self._wait = 0.0
        self._next = 0.0

    def check(self, started: float, now: float) -> None:
        """Called while a collective started at ``started`` (``time.monotonic()``) is not done:
        probes when due, raises ``PeerUnreachableError`` for a peer that is gone or cut off."""
        if now - started < PROBE_AFTER_S or now < self._next:
            return
        if started != self._wait:  # an outage another collective rode out counts for nothing here
            self._wait = started
            self._unanswered.clear()
        for peer in self._peers:
            outcome = probe(peer)
            for other in ("no answer", "silent"):
                if other != outcome:
                    self._unanswered.pop((peer.rank, other), None)
            if outcome is None:
                continue
            who = f"{self._label}: rank {peer.rank} on node {peer.node}"
            if outcome == "refused":
                raise PeerUnreachableError(
                    f"{who} ({peer.host}) refused a connection after this rank had waited {now - started:.0f} s for it: its process "
                    f"is gone (see that rank's own error)")
            waited = time.monotonic() - self._unanswered.setdefault((peer.rank, outcome), now)
            if outcome == "no answer" and waited >= unreachable_seconds():
                raise PeerUnreachableError(
                    f"{who} ({peer.host}) has not answered for {waited:.0f} s (this rank waited {time.monotonic() - started:.0f} s "
                    f"for it): the network between the nodes is cut or its host is down. The job cannot continue "
                    f"({envvars.PEER_TIMEOUT} sets how long an unanswering peer is waited for).")
            if outcome == "silent" and waited >= hung_seconds():
                raise PeerUnreachableError(
                    f"{who} ({peer.host}) hangs: its host answers but its process has not for {waited:.0f} s (this rank waited "
                    f"{time.monotonic() - started:.0f} s for it): it is stopped (SIGSTOP, a debugger) or deadlocked. "
                    f"The job cannot continue ({envvars.PEER_HUNG_TIMEOUT} sets how long a hung peer is waited "
                    f"for; a peer busy computing or writing a checkpoint answers and is waited for).")
        self._next = time.monotonic() + PROBE_EVERY_S

    def explain(self, error: BaseException) -> PeerUnreachableError:
        """The error for a collective of the group that Gloo failed (a member's connection broke):
        names the members whose beacons no longer answer, and keeps Gloo's own first line."""
        gone = [peer for peer in self._peers if probe(peer) is not None]
        who = (", ".join(f"rank {peer.rank} on node {peer.node} ({peer.host})" for peer in gone)
               or "another member")
        gloo = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return PeerUnreachableError(f"{self._label}: {who} left the collective (its process is gone, or the network "
                                    f"between the nodes broke); Gloo said: {gloo}")
