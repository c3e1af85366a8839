"""Local gradient aggregation for the Keras optimizer: ``backward_passes_per_step`` > 1.

Horovod 0.28.1's Keras optimizer (``horovod/tensorflow/gradient_aggregation_eager.py``) sums
each pass's gradients locally; the N-th pass synchronizes the sums (divided by N when
``average_aggregated_gradients``) and applies them. The passes in between apply nothing
but advance ``optimizer.iterations``, so a learning-rate schedule and Adam's bias correction
count passes, not updates. Here the bridge's torch optimizer does the summing and the
synchronizing (its own ``backward_passes_per_step``), and ``apply_every_nth`` decides at run
time, on a TensorFlow counter, whether the update of this pass is due: a ``tf.cond`` that works
eagerly and inside ``tf.function``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from hybridsync.tensorflow.bridge import GradientBridge, scaled


class LocalAggregation:
    """How one Keras optimizer accumulates: N passes, averaged over N or not; one counter per bridge."""

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool) -> None:
        assert backward_passes_per_step > 1
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self._counters: dict[int, tf.Variable] = {}

    def _counter(self, bridge: GradientBridge) -> tf.Variable:
        """Passes this bridge synchronized so far (it counts them in Python; a graph needs a tensor)."""
        if id(bridge) not in self._counters:
            with tf.init_scope():  # made eagerly, also when first asked for while a step is traced
                self._counters[id(bridge)] = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                         name="hybridsync_backward_passes")
        return self._counters[id(bridge)]

    def apply_every_nth(self, optimizer: Any, bridge: GradientBridge, synced: Sequence[Any],
                        apply: Callable[[list[Any]], Any]) -> tf.Tensor:
        """After ``bridge.synchronize`` gave ``synced`` (local sums, or on the N-th pass the
        synchronized sums): ``apply`` them and end the bridge's step on the N-th pass, else only
        advance ``optimizer.iterations``. Returns whether this pass applied."""
        passes = self.backward_passes_per_step
        counter = self._counter(bridge)
        counter.assign_add(1)
        due = tf.equal(counter % passes, 0)
        gradients = list(synced)
        if self.average_aggregated_gradients:
            gradients = [scaled(g, 1.0 / passes) for g in gradients]
        _build(optimizer, bridge.variables)  # no variable may be made inside the tf.cond below

        def update() -> tf.Tensor:
            apply(gradients)
            # After this step's synchronize and update: reads of the updated variables come after their writes.
            after = [] if tf.executing_eagerly() else [
                *(t for t in tf.nest.flatten(gradients, expand_composites=True) if t is not None),
                *(tf.convert_to_tensor(v) for v in bridge.variables)]
            ended = bridge.after_update(after)
            with tf.control_dependencies([] if ended is None else [ended]):
                return tf.constant(True)

        def accumulate() -> tf.Tensor:
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(due, update, accumulate)


def _build(optimizer: Any, variables: Sequence[tf.Variable]) -> None:
    """Keras 3 makes its slot variables at the first ``apply_gradients`` unless built: build now,
    eagerly. (Keras 2 optimizers build under their own ``init_scope``, as Horovod relies on.)"""
    if getattr(optimizer, "built", True) is False:
        with tf.init_scope():
            optimizer.build(list(variables))
