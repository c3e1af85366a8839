"""Saying on stderr what a joining parameter-server worker waits for, while it waits.

A worker joins in three phases that each block: the rendezvous store (hosted by server 0, or
by its supervisor), the RPC group, then every server. A hand-started server 0 that hangs
(stopped, swapped out) accepts the worker's connection in the kernel and never answers, so the
worker waited out the store's 120 s and then the join's 120 s with no word at all. Now the
phases share one deadline (``HYBRIDSYNC_PS_JOIN_TIMEOUT``, default 120 s) and a notice says,
every ``NOTICE_INTERVAL_S``, what is awaited, where, and for how long, from a quarter of that
deadline on: servers that start after the workers on a busy machine can take longer than 10 s
(each imports torch), and a notice at 10 s then read like a fault in a healthy job's log.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Callable

from hybridsync import envvars

NOTICE_INTERVAL_S = 10.0
"""Seconds between notices (at most: a shorter join timeout gets at least ``MIN_NOTICES``)."""
MIN_NOTICES = 4
FIRST_NOTICE_SHARE = 0.25
"""The first notice comes after this share of the deadline (30 s of the default 120 s)."""
PROBE_TIMEOUT_S = 1.0


def store_state(address: str, port: int) -> str:
    """What the rendezvous store's address says right now: nothing listens, or a listener that
    does not answer (the store's host is stopped or hung)."""
    try:
        with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S):
            return "it accepts connections but does not answer: is that process stopped or hung?"
    except OSError as e:
        return f"nothing answers there ({e.strerror or e}): is it started, and are the address and port right?"


class WaitNotice:
    """While the ``with`` block runs, print ``<who>: still waiting ... for <awaited()>`` on stderr
    every interval once a quarter of ``timeout_s`` has passed; the caller sets ``awaited`` as it
    moves from phase to phase."""

    def __init__(self, who: str, timeout_s: float, awaited: Callable[[], str]) -> None:
        self.who = who
        self.timeout_s = timeout_s
        self.awaited = awaited
        self.interval_s = min(NOTICE_INTERVAL_S, max(timeout_s / MIN_NOTICES, 0.5))
        self.first_notice_s = max(FIRST_NOTICE_SHARE * timeout_s, self.interval_s)
        self._start = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridsync-ps-wait-notice", daemon=True)

    def remaining(self) -> float:
        """Seconds left of the shared deadline (never below a small positive floor: torch takes no 0)."""
        return max(self.timeout_s - (time.monotonic() - self._start), 0.1)

    def __enter__(self) -> WaitNotice:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 1.0)

    def _run(self) -> None:
        if self._done.wait(self.first_notice_s - self.interval_s):
            return
        while not self._done.wait(self.interval_s):
            waited = time.monotonic() - self._start
            try:
                what = self.awaited()
            except Exception as e:  # noqa: BLE001 - a notice must never end the join
                what = f"(could not say: {e})"
            print(f"hybridsync PS {self.who}: still waiting after {waited:.0f} s (an error at {self.timeout_s:.0f} s, "
                  f"{envvars.PS_JOIN_TIMEOUT}) for {what}", file=sys.stderr, flush=True)
