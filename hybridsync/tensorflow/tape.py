"""``DistributedGradientTape``: ``horovod.tensorflow.DistributedGradientTape`` routed by a strategy."""
from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from hybridsync.tensorflow.bridge import Bridges, scaled
from hybridsync.horovod_options import SyncOptions
from hybridsync.tensorflow.options import checked_options, refuse_dynamic_sync


_OWNER = "DistributedGradientTape"
_EAGER_OPTIONS_KEPT = 4
_EAGER_LISTS_KEPT = 8
_eager_bridges: list[tuple[SyncOptions, Bridges]] = []
"""The bridges of eager tapes by their options' ``_reuse_key``, the most recently used last. An eager
loop builds a tape every step (as Horovod's examples do); each takes the bridges of the previous tapes
of the same options, so the torch optimizer under them lives across steps as a Keras optimizer's
does: built once (a collective, ~50 ms), one plan, one ``backward_passes_per_step`` count, one set
of step hooks (profiler, trials). At most ``_EAGER_OPTIONS_KEPT`` options x ``_EAGER_LISTS_KEPT``
lists of variables are kept alive."""


def _bridges_for(options: SyncOptions) -> Bridges:
    """A tape's bridges: in a graph its own (built once, when the step is traced); eagerly, those of
    the previous eager tapes under equal options. Every rank builds its tapes in the same order, so
    every rank reuses (or builds, a collective) the same bridges."""
    if not tf.executing_eagerly():
        return Bridges(options, allow_parameter_exchange=False, owner=_OWNER)
    key = _reuse_key(options)
    for entry in _eager_bridges:
        if entry[0] == key:
            _eager_bridges.remove(entry)
            _eager_bridges.append(entry)
            return entry[1]
    made = Bridges(options, allow_parameter_exchange=False, owner=_OWNER, keep=_EAGER_LISTS_KEPT)
    _eager_bridges.append((key, made))
    del _eager_bridges[:-_EAGER_OPTIONS_KEPT]
    return made


def _reuse_key(options: SyncOptions) -> SyncOptions:
    """``options`` with the variables in ``groups`` by identity (a variable's ``==`` compares values)."""
    if not isinstance(options.groups, list):
        return options
    return dataclasses.replace(options, groups=[[id(v) for v in group] for group in options.groups])


class _DistributedGradientTape(tf.GradientTape):
    """Mixin whose ``__dict__`` becomes a subclass of the user's tape class (as Horovod does)."""

    def __init__(self, tape: Any, options: SyncOptions, persistent: bool = False,
                 watch_accessed_variables: bool = True) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._hybridsync = options
        self._bridges = _bridges_for(options)
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

        def others_watched() -> list:
            """A GAN's two tapes each watch both models' variables: the first tape's strategy check
            knows the second's, which that tape's bridge, built after it, will hold."""
            mine = {id(s) for s in flat_sources}
            return [v for v in self.watched_variables() if id(v) not in mine]
        bridge = self._bridges.for_variables(shared, others_watched)
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

