"""hybridsync for TensorFlow 2: ``import hybridsync.tensorflow as hst`` replaces ``import horovod.tensorflow as hvd``.

``hst.DistributedGradientTape`` and ``hybridsync.tensorflow.keras.DistributedOptimizer`` take
Horovod's arguments plus ``strategy=`` (or ``HYBRIDSYNC_STRATEGY``) and route each
variable's gradient by the same strategy files as PyTorch jobs, over the same routes and
``hybridsync-server`` processes (see ``bridge.py`` for how). Without a strategy every
variable is ring all-reduced under its own name, as Horovod does.

The process functions (``init``, ``rank``, ``size``, ``local_rank``, ``broadcast_object``...)
are Horovod's, from ``horovod.torch``: hybridsync's runtime runs on Horovod's PyTorch
core. A plan that Horovod's TensorFlow ops express exactly syncs in the graph with those ops
(``horovod_ops.py``), on ``horovod.tensorflow``'s core, which hybridsync starts itself
(``horovod_core.py``). Do not ``hvd.init()`` from ``horovod.tensorflow`` before ``init``
(``init`` says so if it finds it initialized).
``allreduce``, ``allgather``, ``broadcast`` and ``broadcast_variables`` take TensorFlow
tensors and variables, eagerly and inside ``tf.function``.
"""
from __future__ import annotations

import itertools
import sys
from typing import Any, Sequence

try:
    import tensorflow as tf
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"hybridsync.tensorflow needs TensorFlow, which does not import here ({error}). "
                      f"`make test` (scripts/bootstrap.sh) installs the version hybridsync is tested with; "
                      f"see docs/guides/tensorflow.md.") from error

from hybridsync.backends import waiting
from hybridsync.frameworks import (HOROVOD_PROCESS_FUNCTIONS, Adasum, Average, Sum,  # noqa: F401 (hst.Adasum)
                                   check_op, horovod_torch)
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.tensorflow.tape import DistributedGradientTape

_NAMES = itertools.count()
"""Numbers the collectives these helpers start: every rank calls them in the same order."""

__all__ = ["Strategy", "VarConfig", "DistributedGradientTape", "Compression", "Average", "Sum", "init",
           "allreduce", "allgather", "broadcast", "broadcast_variables", *sorted(HOROVOD_PROCESS_FUNCTIONS)]


def __getattr__(name: str) -> Any:
    if name in HOROVOD_PROCESS_FUNCTIONS:
        return getattr(horovod_torch(f"hybridsync.tensorflow.{name}"), name)
    if name == "Compression":
        from hybridsync.compression import Compression
        return Compression
    raise AttributeError(f"module 'hybridsync.tensorflow' has no attribute {name!r}")


def init(*args: Any, **kwargs: Any) -> None:
    """Horovod's ``init`` (``horovod.torch.init``'s arguments), refusing a second Horovod core. From
    here on this process waits for collectives as Horovod's TensorFlow ops do, holding no core
    (``backends.waiting.wait_like_callbacks``; ``HYBRIDSYNC_WAIT=spin`` spins as horovod.torch does)."""
    other = sys.modules.get("horovod.tensorflow")
    if other is not None and getattr(other, "is_initialized", lambda: False)():
        raise RuntimeError("horovod.tensorflow is already initialized in this process; hybridsync.tensorflow runs "
                           "on horovod.torch's core and starts horovod.tensorflow's itself, on a rendezvous of its "
                           "own (two cores meeting on the launcher's rendezvous read each other's addresses). Call "
                           "hybridsync.tensorflow.init() first, or use its functions instead of horovod.tensorflow's.")
    horovod_torch("hybridsync.tensorflow.init").init(*args, **kwargs)
    waiting.wait_like_callbacks()


def allreduce(tensor: Any, op: int = Average, name: str | None = None) -> tf.Tensor:
    """``tensor`` averaged (``op=Average``) or summed (``Sum``) over every rank."""
    check_op(op)
    hvd = horovod_torch("hybridsync.tensorflow.allreduce")
    return _through_torch(lambda t: hvd.allreduce(t, op=hvd.Average if op == Average else hvd.Sum,
                                                  name=name or f"hybridsync.tf.allreduce.{next(_NAMES)}"), tensor)


def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    hvd = horovod_torch("hybridsync.tensorflow.allgather")
    return _through_torch(lambda t: hvd.allgather(t, name=name or f"hybridsync.tf.allgather.{next(_NAMES)}"), tensor)


def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank."""
    hvd = horovod_torch("hybridsync.tensorflow.broadcast")
    return _through_torch(lambda t: hvd.broadcast(t, root_rank,
                                                  name=name or f"hybridsync.tf.broadcast.{next(_NAMES)}"), tensor)


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int) -> tf.Operation | None:
    """Assign rank ``root_rank``'s values to ``variables`` on every rank (e.g. after the first step,
    once Keras has created them all), as ``horovod.tensorflow.broadcast_variables``.

    Inside ``tf.function`` it reads the variables and assigns them in the graph, as Horovod's does, so
    TensorFlow orders it after the step's earlier updates of them (``apply_gradients``): it broadcasts
    the updated values, and every later read sees the broadcast ones."""
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()

    def broadcast_all(*values: Any) -> list:
        from hybridsync.tensorflow.bridge import torch_copy
        hvd = horovod_torch("hybridsync.tensorflow.broadcast_variables")
        prefix = f"hybridsync.tf.broadcast_variables.{next(_NAMES)}"
        copies = [torch_copy(v) for v in values]
        handles = [hvd.broadcast_async_(t, root_rank, name=f"{prefix}.{i}") for i, t in enumerate(copies)]
        for handle in handles:
            hvd.synchronize(handle)
        return [c.numpy() for c in copies]

    if tf.executing_eagerly():
        for variable, value in zip(variables, broadcast_all(*variables)):
            variable.assign(value)
        return None
    values = tf.py_function(broadcast_all, [tf.convert_to_tensor(v) for v in variables],
                            [tf.as_dtype(v.dtype) for v in variables], name="hybridsync_broadcast_variables")
    for variable, value in zip(variables, values):
        value.set_shape(variable.shape)  # Keras 3 variables assign values of their own shape only
    return tf.group(*[variable.assign(value) for variable, value in zip(variables, values)])


def _through_torch(collective: Any, tensor: Any) -> tf.Tensor:
    """Run a Horovod collective on a copy of ``tensor`` as torch, eagerly or inside ``tf.function``."""
    def run(value: tf.Tensor) -> tf.Tensor:
        from hybridsync.tensorflow.bridge import torch_copy
        return tf.convert_to_tensor(collective(torch_copy(value)).numpy())

    tensor = tf.convert_to_tensor(tensor)
    if tf.executing_eagerly():
        return run(tensor)
    return tf.py_function(run, [tensor], tensor.dtype)
