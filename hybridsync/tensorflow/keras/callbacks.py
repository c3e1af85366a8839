"""Horovod's Keras callbacks that a training script needs, on hybridsync.tensorflow's functions."""
from __future__ import annotations

from typing import Any

import tensorflow as tf


def variables_of(optimizer: Any) -> list:
    """A Keras optimizer's variables (a property in Keras 3 and in Keras 2's new optimizers, a method in older ones)."""
    variables = getattr(optimizer, "variables", [])
    return list(variables() if callable(variables) else variables)


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """After the first batch (when Keras has created every variable), every rank takes ``root_rank``'s
    model and optimizer variables, as ``horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback``."""

    def __init__(self, root_rank: int) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.broadcast_done:
            return
        from hybridsync.tensorflow import broadcast_variables
        broadcast_variables(self.model.variables, root_rank=self.root_rank)
        broadcast_variables(variables_of(self.model.optimizer), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """At the end of each epoch, every metric in ``logs`` averaged over the ranks (Horovod's callback)."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        from hybridsync.tensorflow import allreduce
        for metric in sorted(logs):
            logs[metric] = float(allreduce(tf.constant(float(logs[metric]), tf.float64),
                                           name=f"hybridsync.tf.metric.{epoch}.{metric}"))


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """The learning rate set to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until ``end_epoch``
    (``multiplier``: a function of the epoch, or a number: ``multiplier ** (epoch - start_epoch)``), at
    each epoch's first batch (``staircase``) or at every batch, the epoch counted in fractions; as
    ``horovod.tensorflow.keras.callbacks.LearningRateScheduleCallback``.

    It sets ``optimizer.learning_rate``, which Keras 2 and 3 optimizers both have (Horovod 0.28.1's sets
    ``optimizer.lr`` through the Keras 3 backend, which fails under Keras 2 and 3 alike). With
    ``momentum_correction``, a momentum held in a variable (Keras 2's legacy optimizers) is scaled by
    the new rate over the old for the batch, as Horovod's does; Keras 2's and 3's current optimizers
    compile their momentum into the step as a number, which is left as it is."""

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the "
                                 f"steps_per_epoch parameter to the {type(self).__name__}()")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_learning_rate(self.current_epoch)
        else:
            self._set_learning_rate(self.current_epoch + batch / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = learning_rate_of(self.model.optimizer)

    def _set_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old, new = learning_rate_of(optimizer), self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, tf.Variable) and old:
            self._restore_momentum = float(momentum.numpy())
            momentum.assign(self._restore_momentum * new / old)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """The learning rate raised gradually from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al., "Accurate, Large Minibatch SGD"), at every batch; as
    ``horovod.tensorflow.keras.callbacks.LearningRateWarmupCallback``."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        from hybridsync.tensorflow import size

        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch  # round numbers at each epoch's end, as Horovod's
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        from hybridsync.tensorflow import rank
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{learning_rate_of(self.model.optimizer):g}.")


def learning_rate_of(optimizer: Any) -> float:
    """A Keras optimizer's current learning rate (a variable's value, or a schedule's at ``iterations``)."""
    rate = optimizer.learning_rate
    if callable(rate) and not isinstance(rate, tf.Variable):
        rate = rate(optimizer.iterations)
    return float(tf.convert_to_tensor(rate))
