"""Horovod's TensorFlow core beside hybridsync's (``horovod.torch``'s) in one process.

hybridsync's runtime runs on ``horovod.torch``'s core. Horovod's TensorFlow ops (what the
ring fast path of ``bridge.py`` syncs with, inside the graph) run on the core compiled into
``horovod.tensorflow``: a second core, with its own rendezvous. Under a Gloo launch two cores
cannot share the launcher's rendezvous server: the server keeps the first core's addresses
until every rank has finalized, so a rank that starts the second rendezvous early reads a
stale address and connects to the first core (``gloo::IoException``, or a hang). The second
core therefore meets on a rendezvous server of its own, started by rank 0 for the duration
of ``horovod.tensorflow.init()``. Under MPI each core duplicates the world communicator and
needs nothing more.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

_GLOO_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
_GLOO_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"


def horovod_tensorflow(hvd_torch: Any) -> Any:
    """``horovod.tensorflow``, initialized on the ranks of ``hvd_torch``'s (already initialized) core.

    Collective the first time: every rank calls it at the same point (the bridges call it when
    they are built, which every rank does at its first step)."""
    import horovod.tensorflow as hvd_tf
    if hvd_tf.is_initialized():
        return hvd_tf
    if os.environ.get(_GLOO_ADDR) is None:
        hvd_tf.init()
    else:
        with _own_rendezvous(hvd_torch):
            hvd_tf.init()
    assert (hvd_tf.rank(), hvd_tf.size()) == (hvd_torch.rank(), hvd_torch.size()), "the two cores' ranks differ"
    return hvd_tf


@contextlib.contextmanager
def _own_rendezvous(hvd_torch: Any) -> Iterator[None]:
    """The Gloo rendezvous variables pointing at a fresh server on rank 0, while the block runs."""
    from horovod.runner.http.http_server import RendezvousServer
    server = None
    address = None
    if hvd_torch.rank() == 0:
        server = RendezvousServer()
        address = (_address_toward(os.environ[_GLOO_ADDR]), server.start())
    saved = {name: os.environ.get(name) for name in (_GLOO_ADDR, _GLOO_PORT)}
    host, port = hvd_torch.broadcast_object(address, root_rank=0, name="hybridsync.tf.rendezvous")
    try:
        os.environ[_GLOO_ADDR], os.environ[_GLOO_PORT] = host, str(port)
        yield
    finally:
        for name, value in saved.items():
            os.environ[name] = value  # both were set: a Gloo launch sets them
        hvd_torch.barrier()  # every rank is connected before the server goes
        if server is not None:
            server.stop()


def _address_toward(host: str) -> str:
    """This host's address on the route to ``host`` (the launcher's rendezvous host): the other ranks
    reach that one, as they reach the launcher's server (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]
