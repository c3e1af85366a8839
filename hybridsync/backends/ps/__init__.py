"""The parameter-server route: BytePS-style servers on ``torch.distributed.rpc`` (TensorPipe).

Workers: ``init()`` (settings from ``DMLC_*``/``BYTEPS_*`` variables), then ``PSBackend``
for the router, ``shutdown()`` at the end. Servers: ``python -m hybridsync.backends.ps.server``.
Importing this package does not import torch's RPC; the submodules do.
"""
from __future__ import annotations

from hybridsync.backends.ps.config import DEFAULT_PARTITION_BYTES, PSConfig

__all__ = ["DEFAULT_PARTITION_BYTES", "PSBackend", "PSClient", "PSConfig", "PSServerError", "get_client",
           "init", "shutdown"]


def __getattr__(name: str):
    """Client names load lazily, so reading a config needs no torch import."""
    if name in ("PSBackend", "PSClient", "PSServerError", "get_client", "init", "shutdown"):
        from hybridsync.backends.ps import client
        return getattr(client, name)
    raise AttributeError(name)
