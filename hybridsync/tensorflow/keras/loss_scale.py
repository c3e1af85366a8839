"""Mixed precision: hybridsync's Keras optimizer and Keras's ``LossScaleOptimizer``.

A loss-scale optimizer skips every step whose gradients hold an inf or a NaN (and halves the loss
scale). Wrapped around this optimizer, as ``model.compile`` does under the ``mixed_float16``
policy, it tests each rank's own gradients, before they are synchronized: a step that overflows
on one rank only would be skipped there and applied on the others, which would then wait in a
synchronization that rank never starts, or pair its next step's gradients with this one's.

- Keras 2 (``tf_keras``) asks the wrapped optimizer to aggregate the gradients before it tests
  them (``aggregate_gradients``): there the ranks vote, one all-reduce of a flag per step, and
  every rank's test sees an inf wherever any rank's did (``finite_on_every_rank``).
- Keras 3 asks nothing before its test (its inner optimizer's ``apply`` comes after it): that
  order is refused, naming the one that works, ``DistributedOptimizer(LossScaleOptimizer(opt))``,
  where the loss-scale optimizer tests the synchronized gradients, the same on every rank.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from hybridsync.tensorflow.bridge import scaled
from hybridsync.tensorflow.horovod_ops import agreed
from hybridsync.tensorflow.layout import gradient_values

_CALLER_FRAMES = 4
"""Frames above ``apply`` searched for a wrapping optimizer (decorators and ``tf.cond`` lambdas sit between)."""


def finite_on_every_rank(gradients: Sequence[Any], process_set: Any) -> list[Any]:
    """``gradients`` as they are when every rank's are finite; else with the first one NaN on every
    rank, so that each rank's loss-scale optimizer skips the step. Collective over ``process_set``
    (a ``horovod.torch`` process set), eagerly or inside ``tf.function``."""
    gradients = list(gradients)
    present = [i for i, g in enumerate(gradients) if g is not None]
    if not present:
        return gradients
    local = tf.reduce_all([tf.reduce_all(tf.math.is_finite(gradient_values(gradients[i]))) for i in present])
    everywhere = tf.numpy_function(lambda ok: np.bool_(agreed(bool(ok), process_set=process_set)[0]), [local],
                                   tf.bool, stateful=True, name="hybridsync_finite_on_every_rank")
    everywhere.set_shape([])
    first = gradients[present[0]]
    dtype = gradient_values(first).dtype
    gradients[present[0]] = scaled(first, tf.where(everywhere, tf.constant(1.0, dtype), tf.constant(np.nan, dtype)))
    return gradients


def refuse_loss_scale_wrapper(optimizer: Any) -> None:
    """``ValueError`` if ``optimizer.apply`` was called by a Keras 3 optimizer holding it as its
    ``inner_optimizer`` (a ``LossScaleOptimizer``, which tested each rank's gradients alone)."""
    frame = sys._getframe(1)  # optimizer.apply; above it a decorator's wrapper, then its caller
    for _ in range(_CALLER_FRAMES):
        frame = frame.f_back
        if frame is None:
            return
        caller = frame.f_locals.get("self")
        if caller is not None and caller is not optimizer and getattr(caller, "inner_optimizer", None) is optimizer:
            raise ValueError(
                f"hybridsync.tensorflow.keras.DistributedOptimizer: a {type(caller).__name__} wraps it "
                "(model.compile does so under the mixed_float16 policy), which would test each rank's gradients "
                "for inf/NaN alone and skip a step on some ranks only. Wrap the other way round: "
                "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)) tests the synchronized ones.")
