"""Transports. Each module is one route; the router picks them through ``make_backend``."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from hybridsync.backends.base import (Backend, BackendFactory, Handle, KeyedBackend, ParameterSync,
                                     ParameterSyncFactory, Reduction, RouteUnavailableError, SparseBackend,
                                     StagedBackend)

__all__ = ["Backend", "BackendFactory", "Handle", "KeyedBackend", "ParameterSync", "ParameterSyncFactory",
           "Reduction", "RouteUnavailableError", "SparseBackend", "StagedBackend", "forget_world", "make_backend",
           "make_parameter_sync"]


def make_backend(route: str, variant: str, variables: Iterable[str] = (), namespace: str = "",
                 process_set: Any = None) -> Backend:
    """The backend for a route (``variant``: the all-reduce algorithm, or the PS protocol).

    Unavailable routes fail here, at construction, never silently. Where hierarchical
    all-reduce would be one Horovod all-reduce over the job per message (one rank per node; or
    one node whose ranks cannot share memory), it gets the ring's backend: the same sums, with
    overlap and fusion (sparse gradients sent as on the ring). ASP/SSP are not
    backends (nothing is exchanged per gradient): see ``make_parameter_sync``.
    ``namespace`` prefixes the names a backend keeps beyond one step (parameter-server
    keys), so two routers in one job never share them.
    """
    if route == "allreduce" and variant == "ring":
        from hybridsync.backends.ring import RingAllreduce
        return RingAllreduce(process_set)
    if route == "allreduce" and variant == "hierarchical":
        from hybridsync.backends.hierarchical import HierarchicalAllreduce
        backend = HierarchicalAllreduce()
        if backend.one_collective:
            # The same all-reduce over the job: Horovod's ring runs it with its overlap and fusion,
            # where the hierarchical backend would run one blocking collective per message in
            # synchronize() (benchmarks/RESULTS.md, single_level.py).
            backend.close()
            from hybridsync.backends.ring import RingAllreduce
            return RingAllreduce(process_set)
        return backend
    if route == "ps" and variant == "bsp":
        from hybridsync.backends.ps.route import bsp_backend
        return bsp_backend(namespace)
    names = sorted(variables)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise RouteUnavailableError(f"route {route!r} with {variant!r} has no per-gradient backend (used by: {shown})")


def make_parameter_sync(pieces: Sequence[tuple[str, torch.Tensor, int | None]], staleness: int | None,
                        namespace: str = "") -> ParameterSync:
    """ASP (``staleness=None``) or SSP on the parameter servers for ``(key name, tensor, server)``
    pieces of parameters; its ``push_pull()`` runs after each local optimizer step."""
    from hybridsync.backends.ps.route import parameter_sync
    return parameter_sync(pieces, staleness, namespace)


def forget_world() -> None:
    """Close what backends share across plans for the job's current ranks (the hierarchical
    route's Gloo groups), whichever routers hold it: those ranks are gone (a rank failed, or an
    elastic reset re-formed the job). Peers waiting on this rank there fail at once instead of
    waiting; the next plan builds them for the new world."""
    from hybridsync.backends.hierarchical.groups import forget_hierarchical_groups
    forget_hierarchical_groups()
