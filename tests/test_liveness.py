"""``hybridsync.backends.hierarchical.liveness``: a busy peer is waited for, one that is gone or cut off is named.

Real sockets on loopback: a beacon stands for a live (possibly busy) peer; a closed port for a
host whose process is gone; a listener that never accepts, its queue full, for a peer the
network cut off (its host's kernel does not answer the connection). The emulated test
(``test_netfault_emulated.py``) cuts a real link under a real job.
"""
from __future__ import annotations

import socket
import time

import pytest

from hybridsync.backends.hierarchical import liveness
from hybridsync.backends.hierarchical.liveness import Peer, PeerUnreachableError, PeerWatch

pytestmark = pytest.mark.unit
ROUTE = "hierarchical all-reduce across nodes (rank 0, node 0)"


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as server:
        return server.getsockname()[1]


def test_a_busy_peer_is_waited_for_however_long():
    own = liveness.beacon("127.0.0.1")
    watch = PeerWatch([Peer(2, 1, own.host, own.port)], ROUTE)
    started = time.monotonic() - 600.0  # a peer writing a checkpoint for ten minutes
    for _ in range(3):
        watch.check(started, time.monotonic() + 2 * liveness.PROBE_EVERY_S)


def test_a_peer_whose_process_is_gone_fails_at_once_naming_it():
    watch = PeerWatch([Peer(2, 1, "127.0.0.1", _closed_port())], ROUTE)
    now = time.monotonic()
    watch.check(now, now)  # a wait shorter than PROBE_AFTER_S probes nothing
    with pytest.raises(PeerUnreachableError, match=r"across nodes \(rank 0, node 0\): rank 2 on node 1 "
                                                   r"\(127\.0\.0\.1\) refused a connection"):
        watch.check(now - liveness.PROBE_AFTER_S, now)


def test_a_peer_cut_off_fails_after_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_PEER_TIMEOUT", "1.5")
    with socket.create_server(("127.0.0.1", 0), backlog=0) as silent:
        port = silent.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills its queue: further connections get no answer
            _fails_within_its_timeout(Peer(3, 1, "127.0.0.1", port), r"rank 3 on node 1 \(127\.0\.0\.1\) has not "
                                      r"answered for \d+ s .*HYBRIDSYNC_PEER_TIMEOUT")


def _fails_within_its_timeout(peer: Peer, error: str, timeout_s: float = 1.5) -> None:
    """``peer``, probed as a wait goes on, is not an error at the first probe, then ``error`` within
    ``timeout_s`` and a few probes."""
    watch = PeerWatch([peer], ROUTE)
    started = time.monotonic() - liveness.PROBE_AFTER_S
    watch.check(started, time.monotonic())  # first probe: not yet
    deadline = time.monotonic() + 10.0
    with pytest.raises(PeerUnreachableError, match=error):
        while time.monotonic() < deadline:
            watch.check(started, time.monotonic())
            time.sleep(0.05)
    assert time.monotonic() - started < liveness.PROBE_AFTER_S + timeout_s + 3 * liveness.CONNECT_TIMEOUT_S + 1.0


def test_a_collective_gloo_failed_names_the_members_that_are_gone():
    own = liveness.beacon("127.0.0.1")
    watch = PeerWatch([Peer(1, 0, own.host, own.port), Peer(2, 1, "127.0.0.1", _closed_port())], ROUTE)
    error = watch.explain(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:51329: "
                                       "Connection reset by peer. This is typically caused by ...\nmore"))
    assert str(error) == (f"{ROUTE}: rank 2 on node 1 (127.0.0.1) left the collective (its process is gone, or the "
                          f"network between the nodes broke); Gloo said: [../gloo/transport/tcp/pair.cc:537] Read "
                          f"error [10.77.0.2]:51329: Connection reset by peer. This is typically caused by ...")


def test_an_outage_another_collective_rode_out_does_not_count_against_the_next(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_PEER_TIMEOUT", "1.5")
    with socket.create_server(("127.0.0.1", 0), backlog=0) as silent:
        port = silent.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            watch = PeerWatch([Peer(3, 1, "127.0.0.1", port)], ROUTE)
            first_wait = time.monotonic() - liveness.PROBE_AFTER_S
            watch.check(first_wait, time.monotonic())  # unanswered; then that collective completed
            time.sleep(2.0)  # longer than the peer timeout
            next_wait = time.monotonic() - liveness.PROBE_AFTER_S
            watch.check(next_wait, time.monotonic())  # one unanswered probe of a new wait: not yet an error


def test_a_hung_peer_fails_after_the_hung_timeout_naming_it(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_PEER_HUNG_TIMEOUT", "1.5")
    with socket.create_server(("127.0.0.1", 0), backlog=64) as stopped:  # its kernel connects; nothing answers
        _fails_within_its_timeout(Peer(2, 1, "127.0.0.1", stopped.getsockname()[1]),
                                  r"rank 2 on node 1 \(127\.0\.0\.1\) hangs: its host answers but its process has "
                                  r"not for \d+ s .*HYBRIDSYNC_PEER_HUNG_TIMEOUT")


def test_a_hung_peer_is_waited_for_as_long_as_horovod_waits(monkeypatch):
    monkeypatch.delenv("HYBRIDSYNC_PEER_HUNG_TIMEOUT", raising=False)
    monkeypatch.delenv("HOROVOD_GLOO_TIMEOUT_SECONDS", raising=False)
    assert liveness.hung_seconds() == 30.0
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "120")  # horovodrun --gloo-timeout-seconds 120
    assert liveness.hung_seconds() == 120.0
    monkeypatch.setenv("HYBRIDSYNC_PEER_TIMEOUT", "1.5")  # the unreachable bound does not apply to a hung peer
    with socket.create_server(("127.0.0.1", 0), backlog=64) as stopped:
        watch = PeerWatch([Peer(2, 1, "127.0.0.1", stopped.getsockname()[1])], ROUTE)
        started = time.monotonic() - liveness.PROBE_AFTER_S
        for _ in range(3):
            watch.check(started, time.monotonic() + 2 * liveness.PROBE_EVERY_S)
