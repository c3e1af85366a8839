"""The parameter-server route: BytePS-style servers on ``torch.distributed.rpc`` (TensorPipe).

Launch (BytePS's vocabulary; see ``config.py`` for the rank layout)::

    DMLC_ROLE=server DMLC_SERVER_ID=i DMLC_NUM_SERVER=K DMLC_NUM_WORKER=N \\
    DMLC_PS_ROOT_URI=<host of server 0> DMLC_PS_ROOT_PORT=<free port> \\
        python -m hybridsync.backends.ps.server --supervise   # K of these, then N workers

``--supervise`` replaces a server that dies or hangs; the workers restore its keys and
resend what it never answered (``recovery.py``), so training goes on with nothing lost.

Worker side::

    from hybridsync.backends import ps
    client = ps.init()                 # same DMLC_* env; worker id: DMLC_WORKER_ID or HOROVOD_RANK
    backend = ps.PSBackend(client, namespace="opt0")   # the router's Backend; keys "opt0/<message>"
    backend.declare_all([(message_name, tensors, server_or_None), ...])   # once, plan order
    ...
    backend.close()                    # done with "opt0/..." keys: servers drop them once every worker is
    ps.shutdown()                      # also registered atexit; servers exit after the last worker

ASP/SSP: ``hybridsync.backends.ps.asp.AsyncParameterSync``.
"""
from __future__ import annotations

from hybridsync.backends.ps.config import PSConfig
from hybridsync.placement import DEFAULT_PARTITION_BYTES

__all__ = ["DEFAULT_PARTITION_BYTES", "PSBackend", "PSClient", "PSConfig", "PSServerError", "get_client",
           "init", "shutdown"]


def __getattr__(name: str):
    """Client names load on first use; ``PSConfig`` alone needs only the environment."""
    if name in ("PSBackend", "PSClient", "PSServerError", "get_client", "init", "shutdown"):
        from hybridsync.backends.ps import client
        return getattr(client, name)
    raise AttributeError(name)
