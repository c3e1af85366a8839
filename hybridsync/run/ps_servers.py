"""The parameter servers of a job: the command that starts one and the environment it shares with the workers.

Every launcher that starts servers beside the workers (``hybridsync-run``, the emulated
cluster's ``launch_servers``, ``hybridsync cluster run --servers``) writes the same BytePS
launch vocabulary, which ``hybridsync.backends.ps.config`` reads on the other side. It is
written here once, so a launcher can differ only in where it puts the servers.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Iterator, Mapping

from hybridsync import envvars

SERVER_MODULE = "hybridsync.backends.ps.server"
"""Also the ``hybridsync-server`` console script; run as a module so that it is the
interpreter (and ``PYTHONPATH``) of the launcher that serves."""


def server_command(*, supervise: bool = True) -> list[str]:
    """``python -m hybridsync.backends.ps.server --supervise`` with this interpreter: a supervisor
    that starts a replacement whenever the server dies or hangs (the workers restore its keys)."""
    return [sys.executable, "-m", SERVER_MODULE, *(["--supervise"] if supervise else [])]


def ps_environment(*, num_workers: int, num_servers: int, root_uri: str, root_port: int,
                   partition_bytes: int | None = None) -> dict[str, str]:
    """What servers and workers share: the counts, server 0's address (it hosts the rendezvous)
    and, when given, the key size (``BYTEPS_PARTITION_BYTES``; unset: the route's default)."""
    env = {envvars.DMLC_NUM_WORKER: str(num_workers), envvars.DMLC_NUM_SERVER: str(num_servers),
           envvars.DMLC_PS_ROOT_URI: root_uri, envvars.DMLC_PS_ROOT_PORT: str(root_port)}
    if partition_bytes:
        env[envvars.PARTITION_BYTES] = str(partition_bytes)
    return env


def server_environment(server_id: int | None = None, *, host: str | None = None) -> dict[str, str]:
    """What one server adds to ``ps_environment``: its role, its id (``None``: the server takes
    it from its launcher's rank, ``--id-from-launcher-rank``) and its own address, if known."""
    env = {envvars.DMLC_ROLE: "server"}
    if server_id is not None:
        env[envvars.DMLC_SERVER_ID] = str(server_id)
    if host is not None:
        env[envvars.DMLC_NODE_HOST] = host
    return env


def any_worker_joined(env: Mapping[str, str], *, timeout_s: float = 5.0) -> bool:
    """Whether any worker of the job ``env`` describes (``ps_environment``) joined its servers, as the
    rendezvous store (server 0's supervisor hosts it) says. ``True`` when the store cannot be asked
    within ``timeout_s``: a launcher then keeps its servers' grace, as it would without asking.
    ``False`` when nothing listens at the store's address (refused): asked of a job's live servers, their
    store is not up yet (server 0 still starting, tens of seconds on a loaded host, after a short job
    ended), so no worker can have joined; or it closed as every member left, and the servers are
    leaving on their own.

    A job whose strategy never routes to the PS starts servers only when asked to (``--num-servers``,
    a config's ``num_servers``), and its workers never join them: those servers would wait out their
    join timeout, and the launcher its grace, for nothing.
    """
    try:
        # A store that is not (or no longer) there is answered at once, where torch's client would retry
        # for timeout_s and print a C++ trace per try; and before torch is imported (3 s on a loaded host).
        address = (env[envvars.DMLC_PS_ROOT_URI], int(env[envvars.DMLC_PS_ROOT_PORT]))
        socket.create_connection(address, timeout=1.0).close()
    except ConnectionRefusedError:
        return False
    except (KeyError, ValueError, OSError):  # settings not those of a PS job, or no answer: not "no"
        return True
    from hybridsync.backends.ps import group
    from hybridsync.backends.ps.config import PSConfig
    try:
        config = PSConfig.from_env(env, role="worker", index=0)
        with _quiet_stderr():  # the store may still close in between
            store = group.open_store(config, timeout_s=timeout_s)
        return group.any_worker_joined(store, config.num_workers)
    except (OSError, RuntimeError, ValueError):  # no store to ask, or settings not those of a PS job
        return True


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Nothing written to file descriptor 2 (torch's C++ log included) reaches it meanwhile."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
