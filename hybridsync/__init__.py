"""hybridsync: per-variable gradient synchronization for Horovod data-parallel training.

``import hybridsync as hs`` replaces ``import horovod.torch as hvd`` in a training
script. ``hs.DistributedOptimizer`` takes an extra ``strategy=`` (or reads
``HYBRIDSYNC_STRATEGY``); without one it behaves exactly like Horovod's.
``hs.broadcast_optimizer_state`` is Horovod's, made aware of hybridsync's optimizer, and
``hs.elastic`` Horovod's elastic training (``run``, ``TorchState``), made aware of its plans. The
process functions (``init``, ``rank``, ``size``, ``broadcast_parameters``...) are Horovod's own,
imported on first use so that ``import hybridsync`` works where Horovod is absent
(e.g. to run the search or ``hybridsync explain`` on a laptop).
"""
from __future__ import annotations

import importlib
from typing import Any

from hybridsync import failure_notes
from hybridsync.frameworks import HOROVOD_PROCESS_FUNCTIONS, HOROVOD_TORCH_FUNCTIONS, Average, Sum, horovod_torch
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.version import __version__

failure_notes.install()  # under hybridsync-run: an uncaught exception is noted, to name the rank that failed
_HOROVOD_FUNCTIONS = HOROVOD_PROCESS_FUNCTIONS | HOROVOD_TORCH_FUNCTIONS
_LAZY = {
    "DistributedOptimizer": "hybridsync.optimizer",
    "Compression": "hybridsync.compression",
    "broadcast_optimizer_state": "hybridsync.horovod_options",
}

_SUBMODULES = ("elastic",)
"""``hs.elastic.run``, ``hs.elastic.TorchState``: Horovod's elastic API, aware of hybridsync's plans."""

__all__ = ["Strategy", "VarConfig", "Average", "Sum", *_SUBMODULES, *sorted(_LAZY), *sorted(_HOROVOD_FUNCTIONS)]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _HOROVOD_FUNCTIONS:
        return getattr(horovod_torch(f"hybridsync.{name}"), name)
    raise AttributeError(f"module 'hybridsync' has no attribute {name!r}")
