"""``DistributedGradientTape``: ``horovod.tensorflow.DistributedGradientTape`` routed by a strategy."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hybridsync.tensorflow.bridge import Bridges, scaled
from hybridsync.horovod_options import SyncOptions
from hybridsync.tensorflow.options import checked_options, refuse_dynamic_sync


class _DistributedGradientTape(tf.GradientTape):
    """Mixin whose ``__dict__`` becomes a subclass of the user's tape class (as Horovod does)."""

    def __init__(self, tape: Any, options: SyncOptions, persistent: bool = False,
                 watch_accessed_variables: bool = True) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._hybridsync = options
        self._bridges = Bridges(options, allow_parameter_exchange=False, owner="DistributedGradientTape")
        self._local_sources: set[int] = set()
        """ids of the worker-local variables."""

    def register_local_source(self, source: tf.Variable) -> None:
        """A worker-local variable: its gradient is never synchronized (scaled by 1/size if
        ``scale_local_gradients``), as in Horovod."""
        self._local_sources.add(id(source))

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 **kwargs: Any) -> Any:
        flat_sources = tf.nest.flatten(sources)
        shared = [s for s in flat_sources if id(s) not in self._local_sources]
        bridge = self._bridges.for_variables(shared)
        if tf.executing_eagerly() or bridge.optimizer.profiler is None:
            bridge.mark_backward_start()
            gradients = super(self.__class__, self).gradient(target, sources, output_gradients, **kwargs)
        else:
            # Profiling a tf.function: the backward pass starts once the target is computed, before any gradient op.
            first = tf.nest.flatten(target)[0]
            marker = tf.py_function(lambda value: bridge.mark_backward_start() or value, [first], first.dtype)
            with tf.control_dependencies([marker]):
                gradients = super(self.__class__, self).gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(gradients, expand_composites=False)
        by_source = {id(s): g for s, g in zip(flat_sources, flat)}  # Keras 3 variables have no ref()
        synced = bridge.synchronize([by_source[id(s)] for s in shared])
        by_source.update({id(s): g for s, g in zip(shared, synced)})
        if self._hybridsync.scale_local_gradients and self._local_sources:
            size = self._hybridsync.size()
            for ref in self._local_sources & set(by_source):
                by_source[ref] = scaled(by_source[ref], 1.0 / size)
        return tf.nest.pack_sequence_as(sources, [by_source[id(s)] for s in flat_sources])


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = None, sparse_as_dense: bool = False, op: int = 0,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = None, scale_local_gradients: bool = True,
                            backward_passes_per_step: int = 1,
                            strategy: Any = None) -> tf.GradientTape:
    """A tape whose ``gradient()`` returns gradients synchronized across ranks.

    Same arguments as ``horovod.tensorflow.DistributedGradientTape`` (v0.28.1; ``device_*``
    are accepted and ignored: hybridsync runs on the CPU), plus ``strategy`` (a ``Strategy``,
    a dict or a JSON/YAML path; ``None``: ``HYBRIDSYNC_STRATEGY``, else ring all-reduce of
    every variable) and ``backward_passes_per_step``: gradients of that many ``gradient()``
    calls are accumulated locally and synchronized together, the calls in between returning
    the local sums (Horovod's local aggregation). Works eagerly and inside ``tf.function``.

    The parameter server's ASP/SSP protocols exchange parameters after the update, which a
    tape never sees: a strategy that uses them, or a dynamic ``sync`` policy, is refused here; use
    ``hybridsync.tensorflow.keras.DistributedOptimizer``, whose ``apply_gradients`` also
    serves custom training loops.
    """
    options = checked_options(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
                              process_set=process_set, scale_local_gradients=scale_local_gradients,
                              backward_passes_per_step=backward_passes_per_step, strategy=strategy)
    refuse_dynamic_sync(options.strategy)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), dict(_DistributedGradientTape.__dict__))
    return cls(gradtape._tape, options, gradtape._persistent, gradtape._watch_accessed_variables)

