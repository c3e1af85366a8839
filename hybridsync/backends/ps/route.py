"""The parameter-server route inside a Horovod job: join the servers once, on every rank.

The router reaches the PS through two entry points: ``bsp_backend()`` (gradients pushed
and pulled per message, the ``Backend`` protocol) and ``parameter_sync()`` (ASP/SSP: the
worker steps locally, then pushes its parameter deltas). Both share one client, joined
with the Horovod rank as the worker id. Before anyone joins, every rank checks its
``DMLC_*`` settings and the ranks agree on the outcome, so a missing or inconsistent
setting fails on every rank within seconds instead of leaving the others waiting to join.
"""
from __future__ import annotations

import atexit
import os
from typing import Callable, Sequence

import torch

from hybridsync.backends.base import RouteUnavailableError
from hybridsync.backends.ps import client as ps_client
from hybridsync.backends.ps.asp import AsyncParameterSync
from hybridsync.backends.ps.config import PSConfig
from hybridsync.placement import namespaced

_LAUNCH_HINT = ("start the job with `hybridsync-run --num-servers K ...` (it starts the servers and sets "
                "DMLC_*), or start `hybridsync-server` processes and set DMLC_NUM_WORKER, DMLC_NUM_SERVER, "
                "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT on every rank, as for BytePS")


def settings_problem(env: dict[str, str] | os._Environ, rank: int, size: int) -> str | None:
    """Why this rank cannot join the servers with ``env`` (``None`` when it can)."""
    try:
        # The worker id is the Horovod rank (checked against the size below), so read the rest with id 0.
        config = PSConfig.from_env(env, role="worker", index=0)
    except ValueError as e:
        return f"the parameter-server route cannot start on rank {rank}: {e}"
    if config.num_workers != size:
        return (f"the parameter-server route cannot start: DMLC_NUM_WORKER={config.num_workers} but the "
                f"Horovod job has {size} ranks (every rank is one PS worker)")
    return None


def joined_client() -> ps_client.PSClient:
    """This rank's PS client (joining the servers on first use), after every rank's settings checked out."""
    if ps_client.initialized():
        return ps_client.get_client()
    import horovod.torch as hvd
    problem = settings_problem(os.environ, hvd.rank(), hvd.size())
    problems = [p for p in hvd.allgather_object(problem, name="hybridsync.ps_check") if p]
    if problems:
        others = f" ({len(problems)} of {hvd.size()} ranks reported a problem)" if len(problems) > 1 else ""
        raise RouteUnavailableError(f"{problems[0]}{others}; {_LAUNCH_HINT}")
    client = ps_client.init(worker_id=hvd.rank())
    shut_down_first(hvd.shutdown)
    return client


_shut_down_first: list[Callable[[], None]] = []


def shut_down_first(shutdown: Callable[[], None]) -> None:
    """Run ``shutdown`` (Horovod's) at exit before the PS client's farewell; registered once per process.

    Exit handlers run last-registered first, and the farewell waits for every worker to leave: a
    rank that raised or ended its loop early must first fail the others' Horovod collectives (as in
    plain Horovod, at once), or each waits for the other. A client joined again (after
    ``ps.shutdown()``) registers its farewell again, so this moves Horovod's after it rather than
    adding a second one."""
    for registered in _shut_down_first:
        atexit.unregister(registered)
    _shut_down_first[:] = [shutdown]
    atexit.register(shutdown)


def bsp_backend(namespace: str = "", client: ps_client.PSClient | None = None) -> ps_client.PSBackend:
    """The router's backend for ``route: "ps"``, ``protocol: "bsp"``; key names prefixed by ``namespace``.

    ``client``: this rank's (default: joined now, see ``joined_client``)."""
    return ps_client.PSBackend(client or joined_client(), namespace=namespace)


def parameter_sync(pieces: Sequence[tuple[str, torch.Tensor, int | None]], staleness: int | None,
                   namespace: str = "", client: ps_client.PSClient | None = None) -> AsyncParameterSync:
    """ASP (``staleness=None``) or SSP sync of parameter ``pieces``: ``(key name, tensor, server or None)``,
    key names prefixed by ``namespace`` as ``PSBackend`` does."""
    named = [(namespaced(namespace, name), tensor, server) for name, tensor, server in pieces]
    return AsyncParameterSync(client or joined_client(), [(key, tensor) for key, tensor, _ in named],
                              staleness=staleness, namespace=namespace,
                              servers={key: server for key, _, server in named if server is not None})
