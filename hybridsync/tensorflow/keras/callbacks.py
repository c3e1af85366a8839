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
