"""The ring fast path: a plan that Horovod's TensorFlow ops express exactly runs as those ops, in the graph.

The bridge (``bridge.py``) hands a step's gradients to the torch runtime through
``tf.numpy_function`` calls, group by group as the backward pass produces them, converting each
to NumPy and torch and back. Horovod's tape instead puts one ``HorovodAllreduce`` op per gradient
in the graph: TensorFlow's executor starts each as soon as its gradient exists, so communication
overlaps the rest of the backward pass, and nothing leaves the graph (nor holds the GIL). When
every variable of a plan is ring all-reduced alone (no partition, no merge, the optimizer's
compression) and nothing rides along the step (no step hook, one backward pass per step, every
rank, not elastic), hybridsync's plan *is* Horovod's tape, and the graph syncs with Horovod's own
ops (``horovod_core.py`` starts their core); anything else keeps the bridge.
"""
from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from hybridsync.frameworks import Average, Sum, horovod_torch
from hybridsync.horovod_options import SyncOptions
from hybridsync.tensorflow.horovod_core import horovod_tensorflow
from hybridsync.world import elastic_job

_DTYPES = frozenset({"float16", "float32", "float64"})
"""Element types Horovod's TensorFlow all-reduce takes on the CPU."""


def options_allow(options: SyncOptions, optimizer: Any) -> bool:
    """Whether anything but the plan keeps this bridge off Horovod's ops for good: options Horovod's tape
    has no op for, a step hook built from the environment (profiler, trials), an elastic job."""
    from hybridsync.compression import Compression
    return (options.backward_passes_per_step == 1 and options.process_set is None and options.groups is None
            and options.op in (Average, Sum) and options.compression in (Compression.none, Compression.fp16)
            and not optimizer.step_hooks and not elastic_job())  # the profiler is a step hook too


def plan_expressed(plan: Any, step_hooks: Sequence[Any] = ()) -> bool:
    """Whether every message of ``plan`` (a ``RoutingPlan``) is one whole variable ring all-reduced with
    the optimizer's compression, and no step hook (e.g. a Sync-Switch controller) runs."""
    if step_hooks:
        return False
    for message in plan.messages:
        config = message.config
        piece = message.pieces[0]
        if (len(message.pieces) != 1 or not piece.whole or config.route != "allreduce"
                or config.algorithm != "ring" or config.compression is not None or piece.dtype not in _DTYPES):
            return False
    return True


def agreed(*local: bool, process_set: Any = None) -> tuple[bool, ...]:
    """Per question, whether ``local`` is true on every rank (of ``process_set``, a ``horovod.torch``
    process set; ``None``: the job), in one collective: e.g. all ranks sync by Horovod's ops, or none does."""
    import torch
    hvd = horovod_torch("hybridsync.tensorflow")
    process_set = hvd.global_process_set if process_set is None else process_set
    votes = hvd.allreduce(torch.tensor([int(answer) for answer in local]), op=hvd.Sum, name="hybridsync.tf.agreed",
                          process_set=process_set)
    return tuple(int(count) == process_set.size() for count in votes.tolist())


class HorovodRing:
    """Horovod's tape's all-reduce of one bridge's gradients, with the bridge's options, as graph ops."""

    def __init__(self, options: SyncOptions, prefix: str) -> None:
        from hybridsync.compression import Compression
        self._hvd = horovod_tensorflow(horovod_torch("hybridsync.tensorflow"))
        self._op = self._hvd.Average if options.op == Average else self._hvd.Sum
        # As Horovod's tape: an average splits gradient_predivide_factor across pre- and postscale.
        factor = options.gradient_predivide_factor if options.op == Average else 1.0
        self._prescale, self._postscale = 1.0 / factor, factor
        self._compression = (self._hvd.Compression.fp16 if options.compression is Compression.fp16
                             else self._hvd.Compression.none)
        self._prefix = prefix

    def allreduce(self, gradients: Sequence[Any], variables: Sequence[tf.Variable],
                  names: Sequence[str]) -> list[Any]:
        """Each gradient all-reduced by its own op, named by its variable; a ``None`` gradient takes
        part with zeros (so no rank waits for it) and stays ``None``. The bridge has already made
        sparse gradients dense under ``sparse_as_dense``."""
        return self.allreduce_all(gradients, variables, names)[0]

    def allreduce_all(self, gradients: Sequence[Any], variables: Sequence[tf.Variable], names: Sequence[str],
                      zeros: Sequence[Any] | None = None) -> tuple[list[Any], list[tf.Tensor]]:
        """``allreduce``, also returning the zeros' all-reduces, which an eager step's small function
        must return (and drop): otherwise TensorFlow's optimizer prunes them (pure ops whose results
        only a control dependency uses), and a rank with a ``None`` gradient took part at the first
        step only; the other ranks then waited for it forever. Such a function also takes the zeros
        as ``zeros`` (``eager_zeros``: one per ``None`` gradient, made outside it): zeros made inside are
        a constant, which it folds with the all-reduce into one constant, run once (the same hang from
        the second step)."""
        out: list[Any] = []
        absent = []
        given = iter(zeros or ())
        for gradient, variable, name in zip(gradients, variables, names):
            zero = None if gradient is not None else next(given, None)
            if gradient is None and zero is None:
                zero = tf.zeros(variable.shape, variable.dtype)
            reduced = self._hvd.allreduce(zero if gradient is None else gradient,
                                          op=self._op, compression=self._compression, prescale_factor=self._prescale,
                                          postscale_factor=self._postscale, name=f"{self._prefix}.{name}")
            if gradient is None:
                absent.append(reduced)
            out.append(None if gradient is None else reduced)
        if absent:  # the zeros' all-reduces run before any result is used
            with tf.control_dependencies(absent):
                out = [None if g is None else _identity(g) for g in out]
        return out, absent


def eager_zeros(gradients: Sequence[Any], variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
    """Eager zeros for the ``None`` gradients, in order (none: an empty list, which adds nothing to the
    function's call; a ``None`` per gradient made each call 2-3x slower): ``HorovodRing.allreduce_all``'s ``zeros``."""
    return [tf.zeros(v.shape, v.dtype) for g, v in zip(gradients, variables) if g is None]


def _identity(gradient: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), gradient.indices, gradient.dense_shape)
    return tf.identity(gradient)
