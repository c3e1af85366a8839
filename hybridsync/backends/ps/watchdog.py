"""Liveness between PS processes: each side pings the peers it depends on over RPC.

Workers ping servers (a dead or hung server fails every worker's ``wait`` with its name);
servers ping workers (a dead worker makes the servers exit instead of waiting forever for
its pushes). A closed connection fails a ping at once; a hung peer fails it after
``timeout_s``.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence


def ping() -> bool:
    """Runs on the pinged process; answering at all is the point."""
    return True


class Watchdog:
    """A daemon thread that pings ``peers`` every ``interval_s`` and reports the first failure."""

    def __init__(self, peers: Sequence[str], on_failure: Callable[[str, str], None], *,
                 interval_s: float = 1.0, timeout_s: float = 10.0) -> None:
        self._peers = list(peers)
        self._on_failure = on_failure
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hybridsync-ps-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def forget(self, peer: str) -> None:
        """Stop watching ``peer`` (it left cleanly)."""
        with self._lock:
            if peer in self._peers:
                self._peers.remove(peer)

    def stop(self) -> None:
        """Stop pinging; returns once no ping of this watchdog is in flight."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._timeout_s + 1.0)

    def _run(self) -> None:
        from torch.distributed import rpc
        while not self._stopped.wait(self._interval_s):
            with self._lock:
                peers = list(self._peers)
            futures = [(peer, rpc.rpc_async(peer, ping, timeout=self._timeout_s)) for peer in peers]
            failed = [(peer, error) for peer, future in futures
                      if (error := _error_of(future, self._timeout_s)) is not None]
            if failed and not self._stopped.is_set():
                self._stopped.set()
                # Every peer lost in this round, in watch order (workers before servers on a server).
                self._on_failure(", ".join(p for p, _ in failed), "; ".join(e for _, e in failed))
                return


def _error_of(future, timeout_s: float) -> str | None:
    """None if the ping came back, else why not (the RPC error, or 'no answer in N s')."""
    deadline = time.monotonic() + timeout_s + 2.0
    while not future.done():
        if time.monotonic() > deadline:  # the RPC timeout should have fired; never trust it blindly
            return f"no answer to a ping within {timeout_s:.0f} s"
        time.sleep(0.05)
    try:
        future.wait()
        return None
    except Exception as e:  # noqa: BLE001 - any RPC failure means the peer is unusable
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
