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

_ZERO: tf.Variable | None = None
"""``_unfolded_zero``'s variable."""
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
    counts, size = _ranks_saying(local, "hybridsync.tf.agreed", process_set)
    return tuple(count == size for count in counts)


def _ranks_saying(local: Sequence[bool], name: str, process_set: Any = None) -> tuple[list[int], int]:
    """Per question, how many ranks of ``process_set`` (``None``: the job) answer ``local`` true, in one
    all-reduce named ``name``; and how many ranks the set has."""
    import torch
    hvd = horovod_torch("hybridsync.tensorflow")
    process_set = hvd.global_process_set if process_set is None else process_set
    votes = hvd.allreduce(torch.tensor([int(answer) for answer in local]), op=hvd.Sum, name=name,
                          process_set=process_set)
    return [int(count) for count in votes.tolist()], process_set.size()


PARTIAL_GRADIENTS = ("hybridsync.tensorflow: inside tf.function, these variables have a gradient on some ranks "
                     "and None on others (a traced step fixes None when traced, so their ranks would train apart); "
                     "give every rank the same variables' gradients (e.g. add 0 * the unused branch's output to "
                     "the loss) or compute the gradients eagerly, where hybridsync returns the reduced gradient on "
                     "every rank:")
"""The error of a traced tape step, through the torch runtime, whose gradient only some ranks have."""


def present_anywhere(present: Sequence[bool], names: Sequence[str], *, in_graph: bool, vote_name: str,
                     process_set: Any) -> list[bool]:
    """Per variable, whether any rank (of ``process_set``, a ``horovod.torch`` process set) has a gradient
    (``present``: this rank's): one small all-reduce, named ``vote_name``, per synchronized step of a tape
    through the torch runtime, after the step's messages. ``in_graph`` (whose ``None`` is fixed when
    traced): ``ValueError`` on every rank naming the variables some ranks have a gradient for and others not."""
    counts, size = _ranks_saying(present, vote_name, process_set)
    if in_graph:
        partial = [name for name, count in zip(names, counts) if 0 < count < size]
        if partial:
            raise ValueError(f"{PARTIAL_GRADIENTS} {', '.join(partial)}")
    return [count > 0 for count in counts]


def shared_gradients(out: Sequence[Any], absent: Sequence[tf.Tensor], presence: tf.Tensor) -> list[Any]:
    """``HorovodRing.allreduce_all``'s results, eagerly: a variable this rank has no gradient for takes the
    reduced one (its zeros' all-reduce) if any rank has a gradient for it, as those ranks do, so every rank
    updates it alike; ``None`` if no rank has one."""
    reduced = iter(absent)
    shared = []
    for gradient, count in zip(out, presence.numpy()):
        if gradient is None:
            zeros_reduced = next(reduced)
            gradient = zeros_reduced if count > 0 else None
        shared.append(gradient)
    return shared


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
        """In a graph: each gradient all-reduced by its own op, named by its variable; a ``None`` gradient
        takes part with zeros (so no rank waits for it) and stays ``None``. The bridge has already made
        sparse gradients dense under ``sparse_as_dense``. (A gradient only some ranks have still hangs here,
        as in Horovod: the zeros are a constant, which TensorFlow folds with their all-reduce.)"""
        return self.allreduce_all(gradients, variables, names)[0]

    def allreduce_all(self, gradients: Sequence[Any], variables: Sequence[tf.Variable], names: Sequence[str],
                      zeros: Sequence[Any] | None = None) -> tuple[list[Any], list[tf.Tensor], tf.Tensor | None]:
        """``allreduce``, also returning the zeros' all-reduces and, given ``zeros`` (an eager step's small
        function), ``presence``: per variable, how many ranks have a gradient for it (``None`` otherwise).

        Such a function must return (and drop) the zeros' all-reduces: otherwise TensorFlow's optimizer
        prunes them (pure ops whose results only a control dependency uses), and a rank with a ``None``
        gradient took part at the first step only; the other ranks then waited for it forever. It also
        takes the zeros as ``zeros`` (``eager_zeros``: one per ``None`` gradient, made outside it): zeros
        made inside are a constant, which it folds with the all-reduce into one constant, run once (the
        same hang from the second step); the presence count starts from a variable's value for that reason."""
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
        presence = None
        if zeros is not None:
            mask = tf.constant([float(g is not None) for g in gradients]) + _unfolded_zero()
            presence = self._hvd.allreduce(mask, op=self._hvd.Sum, name=f"{self._prefix}.presence")
        if absent:  # the zeros' all-reduces run before any result is used
            with tf.control_dependencies(absent):
                out = [None if g is None else _identity(g) for g in out]
        return out, absent, presence


def _unfolded_zero() -> tf.Tensor:
    """0.0 read from a variable (made once per process, outside any function: a traced step made anew on
    its second trace would make another): what TensorFlow cannot fold."""
    global _ZERO
    if _ZERO is None:
        with tf.init_scope():
            _ZERO = tf.Variable(0.0, trainable=False, name="hybridsync_zero")
    return _ZERO.read_value()


def eager_zeros(gradients: Sequence[Any], variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
    """Eager zeros for the ``None`` gradients, in order (none: an empty list, which adds nothing to the
    function's call; a ``None`` per gradient made each call 2-3x slower): ``HorovodRing.allreduce_all``'s ``zeros``."""
    return [tf.zeros(v.shape, v.dtype) for g, v in zip(gradients, variables) if g is None]


def _identity(gradient: Any) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(gradient.values), gradient.indices, gradient.dense_shape)
    return tf.identity(gradient)
