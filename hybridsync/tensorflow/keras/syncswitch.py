"""Sync-Switch (a strategy's ``switch`` / ``elastic`` ``sync`` policy) with a Keras optimizer.

The controller (``hybridsync.hooks.syncswitch``) runs unchanged inside the bridge's torch
optimizer: it counts steps, agrees on switches with the servers and installs the other
protocol's plan. What it does to a torch optimizer's hyperparameters and state, a
``SyncSwitchFollower`` carries over to the Keras optimizer after each update:

- the learning rate: the mirrors' optimizer holds ``lr = 1.0``, which the controller scales by
  ``lr_scale`` entering ASP and restores returning to BSP; the Keras optimizer's learning rate
  (a variable, so a traced step sees the change) becomes the user's value times that factor;
- returning to BSP: every rank already adopted the servers' parameters (the bridge assigns them
  back); the Keras optimizer's floating-point state (momentum, Adam's moments) is averaged over
  the ranks, as the controller averages a torch optimizer's, so BSP restarts from identical replicas.

Refused, with the reason, where it cannot be carried over: a learning-rate schedule (its value
is computed from ``iterations`` in the traced step; there is no variable to scale) and a
``momentum_scale`` other than 1 on an optimizer with momentum (Keras bakes ``momentum`` into
the traced step as a constant).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hybridsync.frameworks import horovod_torch
from hybridsync.tensorflow.bridge import torch_copy
from hybridsync.tensorflow.keras.callbacks import variables_of


def check_sync_policy(optimizer: Any, strategy: Any) -> None:
    """``ValueError`` if ``strategy``'s dynamic ``sync`` policy needs what ``optimizer`` (Keras) cannot do."""
    policy = getattr(strategy, "sync", None)
    if policy is None or not policy.dynamic:
        return
    config = optimizer.get_config()
    if isinstance(config.get("learning_rate"), dict):
        raise ValueError(f"the strategy's `sync` policy {policy.policy!r} scales the learning rate while the "
                         f"parameter server's variables run ASP, and this Keras optimizer's learning rate is a "
                         f"schedule ({config['learning_rate'].get('class_name', 'LearningRateSchedule')}), whose "
                         f"value the compiled step computes itself; use a constant learning rate (e.g. change it "
                         f"with a callback) or a static protocol")
    momentum = config.get("momentum") or 0.0
    if policy.momentum_scale != 1.0 and float(momentum) != 0.0:
        raise ValueError(f"the strategy's `sync` policy has momentum_scale={policy.momentum_scale!r}, and Keras "
                         f"compiles this optimizer's momentum ({float(momentum)}) into the training step as a "
                         f"constant that hybridsync cannot scale; leave momentum_scale at 1 with Keras")


class SyncSwitchFollower:
    """Carries one bridge's Sync-Switch changes over to the Keras optimizer (a ``StepFollower``)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._user_lr: float | None = None
        """The learning rate before the controller scaled it (``None``: not scaled now)."""
        self._controller: Any = None
        self._switches_seen = 0

    def follow(self, optimizer: Any) -> None:
        self._follow_learning_rate(optimizer.param_groups[0]["lr"])
        controller = optimizer.sync_controller
        if controller is not self._controller:  # set_strategy made another (or none): its switches are new
            self._controller, self._switches_seen = controller, 0
        switches = [] if controller is None else controller.switches
        for index in range(self._switches_seen, len(switches)):
            if switches[index].protocol == "bsp":
                self._average_state(f"{controller.job}.{index}")
        self._switches_seen = len(switches)

    def _follow_learning_rate(self, factor: float) -> None:
        scaled = abs(factor - 1.0) > 1e-9  # restoring divides by the factor it multiplied with: ulps off 1
        if scaled and self._user_lr is None:
            self._user_lr = float(self._optimizer.learning_rate.numpy())
        if self._user_lr is None:
            return
        self._optimizer.learning_rate = self._user_lr * factor if scaled else self._user_lr
        if not scaled:
            self._user_lr = None

    def _average_state(self, tag: str) -> None:
        """Every floating-point variable of the Keras optimizer averaged over the ranks (collective)."""
        hvd = horovod_torch("hybridsync.tensorflow.keras (Sync-Switch)")
        state = [v for v in variables_of(self._optimizer) if tf.as_dtype(v.dtype).is_floating]
        values = [torch_copy(v) for v in state]
        handles = [hvd.allreduce_async_(value, op=hvd.Average, name=f"hybridsync.tf.syncswitch.{tag}.{i}")
                   for i, value in enumerate(values)]
        for variable, value, handle in zip(state, values, handles):
            hvd.synchronize(handle)
            variable.assign(value.numpy())
