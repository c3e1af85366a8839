"""Transports. Each module is one route; the router picks them through ``make_backend``."""
from __future__ import annotations

from typing import Iterable

from hybridsync.backends.base import Backend, Handle, Reduction, RouteUnavailableError

__all__ = ["Backend", "Handle", "Reduction", "RouteUnavailableError", "make_backend"]


def make_backend(route: str, algorithm: str, variables: Iterable[str] = ()) -> Backend:
    """The backend for a route; unavailable routes fail here, at construction, never silently."""
    if route == "allreduce" and algorithm == "ring":
        from hybridsync.backends.ring import RingAllreduce
        return RingAllreduce()
    if route == "allreduce" and algorithm == "hierarchical":
        from hybridsync.backends.hierarchical import HierarchicalAllreduce
        return HierarchicalAllreduce()
    what = f"route {route!r}" + (f" with algorithm {algorithm!r}" if route == "allreduce" else "")
    names = sorted(variables)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise RouteUnavailableError(
        f"{what} is not available yet in this version of hybridsync (used by: {shown}); "
        f"route those variables with {{\"route\": \"allreduce\", \"algorithm\": \"ring\"}} instead")
