"""Liveness between PS processes: each side pings the peers it depends on over RPC.

Workers ping servers (a dead or hung server is recovered, or fails every worker's ``wait``
with its name); servers ping workers (a dead worker makes the servers exit instead of
waiting forever for its pushes). A closed connection fails a ping at once; a hung peer
(stopped, or cut off by the network) fails it after ``timeout_s``.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Sequence


SERVER_QUITS = "; exiting, since pushes will never arrive"
"""Ends the error of a server that quits because a worker stopped answering (``Server.fail``).

Its loss is secondary: the worker went away because of an earlier failure, most often another
server's death that failed it, so a worker that gets this error names that primary loss when it
knows of one (``recovery.Links.failure``)."""


def ping() -> bool:
    """Runs on the pinged process; answering at all is the point."""
    return True


@dataclasses.dataclass(frozen=True)
class PeerFailure:
    """A peer that failed a ping."""

    peer: str
    error: str
    hung: bool
    """No answer within the timeout (the process may be alive but stopped or cut off),
    rather than a broken connection."""


class Watchdog:
    """A daemon thread that pings ``peers()`` every ``interval_s`` and reports each round's failures.

    ``peers`` is called every round, so the set watched follows its owner's state (a server
    stops watching a worker that said goodbye; a worker, a server being replaced).
    """

    def __init__(self, peers: Callable[[], Sequence[str]], on_failure: Callable[[list[PeerFailure]], None], *,
                 interval_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self._peers = peers
        self._on_failure = on_failure
        self._interval_s = interval_s
        self.timeout_s = timeout_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridsync-ps-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop pinging; returns once no ping of this watchdog is in flight."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + 3.0)

    def _run(self) -> None:
        from torch.distributed import rpc
        while not self._stopped.wait(self._interval_s):
            futures = []
            for peer in self._peers():
                try:
                    futures.append((peer, rpc.rpc_async(peer, ping, timeout=self.timeout_s)))
                except RuntimeError as e:  # e.g. the peer left the group's view
                    futures.append((peer, e))
            failed = [failure for peer, future in futures
                      if (failure := _failure_of(peer, future, self.timeout_s)) is not None]
            if failed and not self._stopped.is_set():
                self._on_failure(failed)


def _failure_of(peer: str, future, timeout_s: float) -> PeerFailure | None:
    """None if the ping came back, else why not (the RPC error, or 'no answer in N s')."""
    if isinstance(future, BaseException):
        return PeerFailure(peer, _text(future), hung=False)
    deadline = time.monotonic() + timeout_s + 2.0
    while not future.done():
        if time.monotonic() > deadline:  # the RPC timeout should have fired; never trust it blindly
            return PeerFailure(peer, f"no answer to a ping within {timeout_s:.0f} s", hung=True)
        time.sleep(0.05)
    try:
        future.wait()
        return None
    except Exception as e:  # noqa: BLE001 - any RPC failure means the peer is unusable
        text = _text(e)
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        return PeerFailure(peer, f"no answer to a ping within {timeout_s:.0f} s" if timed_out else text,
                           hung=timed_out)


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
