"""A ``TCPStore`` that rank 0 hosts and every other rank reaches, outside Horovod.

Rank 0 offers its addresses (the chosen Gloo interface's first, loopback last) and the
store's port; every other rank connects to the first address that accepts. The
hierarchical route builds its Gloo groups on such a store; the stall watch
(``hybridsync.backends.stalls``) keeps one for the whole job, so ranks can say where they
wait while Horovod itself is stuck.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from hybridsync import envvars

CONNECT_TIMEOUT_S = 5.0
INTERFACE_VARS = envvars.INTERFACE
"""The interface horovodrun (or the user) chose for Gloo; offered first when set."""

Offer = tuple[list[str], int]
"""Rank 0's addresses, best first, and the store's port."""


def host_store(timeout: datetime.timedelta) -> tuple[Any, Offer]:
    """Start a store on rank 0 (any free port, every interface); ``ValueError`` if the chosen
    interface has no IPv4 address here.

    The store listens on every address whatever its host name says; the name is where rank 0's
    own client connects. It is rank 0's first address (the one the others try first), not
    ``0.0.0.0``: torch's client reverse-resolves the address it dialed (in its IPv4-mapped IPv6
    form) and warns ``[c10d] The hostname of the client socket cannot be retrieved`` when that
    fails, and ``0.0.0.0`` is in no hosts file and no DNS zone."""
    import torch.distributed as dist
    addresses = own_addresses()
    store = dist.TCPStore(addresses[0], 0, None, True, timeout=timeout, wait_for_workers=False)
    return store, (addresses, store.port)


def connect_store(address: str, port: int, timeout: datetime.timedelta) -> Any:
    """A client of the store rank 0 hosts at ``address:port``."""
    import torch.distributed as dist
    return dist.TCPStore(address, port, None, False, timeout=timeout)


def own_addresses() -> list[str]:
    """This host's IPv4 addresses, the chosen interface's first, loopback last."""
    import psutil
    wanted = next((os.environ[v] for v in INTERFACE_VARS if os.environ.get(v)), None)
    found: list[tuple[int, str]] = []
    for iface, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET:
                order = 0 if iface == wanted else 2 if address.address.startswith("127.") else 1
                found.append((order, address.address))
    if wanted and not any(order == 0 for order, _ in found):
        raise ValueError(f"interface {wanted!r} (from {'/'.join(INTERFACE_VARS)}) has no IPv4 address on "
                         f"rank 0's host")
    return [address for _, address in sorted(found)] or ["127.0.0.1"]


def reach(candidates: list[str], port: int) -> tuple[str, str] | None:
    """(rank 0's address, our source address) for the first candidate that accepts a connection."""
    for address in candidates:
        try:
            with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S) as probe:
                return address, probe.getsockname()[0]
        except OSError:
            continue
    return None
