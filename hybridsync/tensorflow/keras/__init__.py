"""``hybridsync.tensorflow.keras.DistributedOptimizer``: Horovod's Keras optimizer wrapper, routed by a strategy.

It wraps any Keras optimizer (Keras 2's ``tf.keras`` and Keras 3) by subclassing its class,
as ``horovod.tensorflow.keras`` does: ``apply_gradients`` synchronizes the gradients first,
then applies them, then lets the variables on the parameter server under ASP/SSP exchange
their parameters. ``model.fit`` and custom loops (``tape.gradient`` then
``optimizer.apply_gradients``) both go through it, eagerly or inside ``tf.function``.
``backward_passes_per_step`` > 1 accumulates locally as Horovod's does (``aggregation.py``);
a dynamic ``sync`` policy scales this optimizer's learning rate (``syncswitch.py``); under a
loss-scale optimizer every rank skips the same steps (``loss_scale.py``).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hybridsync.tensorflow.bridge import Bridges, GradientBridge
from hybridsync.tensorflow.keras import callbacks
from hybridsync.tensorflow.keras.aggregation import LocalAggregation
from hybridsync.tensorflow.keras.loss_scale import finite_on_every_rank, refuse_loss_scale_wrapper
from hybridsync.tensorflow.keras.syncswitch import SyncSwitchFollower, check_sync_policy
from hybridsync.tensorflow.options import checked_options


class _DistributedOptimizer:
    """Methods copied into a subclass of the user's optimizer class."""

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        bridge = self._hybridsync.for_variables(variables)
        synced = bridge.synchronize([g for g, _ in grads_and_vars])

        def apply(gradients: list) -> Any:
            self._hybridsync_applying = True  # Keras 3's apply_gradients calls apply: synchronized already
            try:
                return super(self.__class__, self).apply_gradients(list(zip(gradients, variables)), *args, **kwargs)
            finally:
                self._hybridsync_applying = False

        if self._hybridsync_aggregation is not None:
            return self._hybridsync_aggregation.apply_every_nth(self, bridge, synced, apply)
        result = apply(synced)
        bridge.after_update()  # in a tf.function, ordered after the update by its automatic control dependencies
        return result

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Keras 3: what ``apply_gradients`` calls, and what a loop may call itself: synchronized here too."""
        if self._hybridsync_applying:
            return super(self.__class__, self).apply(grads, trainable_variables)
        refuse_loss_scale_wrapper(self)
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        return self.apply_gradients(zip(grads, variables))

    @tf.autograph.experimental.do_not_convert
    def aggregate_gradients(self, grads_and_vars: Any) -> Any:
        """Keras 2: a ``LossScaleOptimizer`` wrapping this one calls this before it tests the gradients
        for inf/NaN; the ranks vote so that all of them skip the step or none does (``loss_scale.py``)."""
        if self._hybridsync_applying:  # this optimizer's own apply_gradients, after synchronizing
            return super(self.__class__, self).aggregate_gradients(grads_and_vars)
        return self._finite_on_every_rank(grads_and_vars)

    @tf.autograph.experimental.do_not_convert
    def _aggregate_gradients(self, grads_and_vars: Any) -> Any:
        """``aggregate_gradients`` of Keras 2's legacy optimizers (``tf.keras.optimizers.legacy``)."""
        if self._hybridsync_applying:
            return super(self.__class__, self)._aggregate_gradients(grads_and_vars)
        return self._finite_on_every_rank(grads_and_vars)

    def _finite_on_every_rank(self, grads_and_vars: Any) -> list:
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        process_set = self._hybridsync.for_variables(variables).optimizer.process_set
        return list(zip(finite_on_every_rank([g for g, _ in grads_and_vars], process_set), variables))

    @property
    def strategy_bridges(self) -> list[GradientBridge]:
        """The bridges built so far (one per distinct variable list): their ``optimizer`` is hybridsync's
        torch ``DistributedOptimizer`` over the variables' mirrors (``set_strategy``, ``plan``...)."""
        return list(self._hybridsync)

    def pull_parameters(self) -> None:
        """Variables on the parameter server under ASP/SSP take the servers' values (eagerly, on every
        rank, after a barrier once the last update is in): every rank then holds the same model."""
        for bridge in self._hybridsync:
            bridge.pull_parameters()

    def set_strategy(self, strategy: Any) -> None:
        """Route gradients by ``strategy`` from the next step on, on every rank (collective, between steps)."""
        options = self._hybridsync.options.with_strategy(strategy)
        check_sync_policy(self, options.strategy)  # refuses what Keras cannot run, first
        for bridge in self._hybridsync:
            bridge.optimizer.set_strategy(options.strategy)
            bridge.refresh_route()  # a traced step syncs by Horovod's ops, or leaves them, from its next run
            bridge.follow()  # a policy that left the learning rate scaled for ASP restores it now
        self._hybridsync.options = options


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: Any = None, sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = 0, backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True, strategy: Any = None) -> Any:
    """``optimizer`` (a Keras optimizer) whose updates use gradients synchronized across ranks.

    Same arguments as ``horovod.tensorflow.keras.DistributedOptimizer`` (v0.28.1; ``device_*``
    are accepted and ignored), plus ``strategy`` (a ``Strategy``, a dict or a JSON/YAML path;
    ``None``: ``HYBRIDSYNC_STRATEGY``, else every variable ring all-reduced). Every strategy
    route works here, ASP/SSP on the parameter server and the dynamic ``sync`` policies
    (``switch``, ``elastic``: the learning rate is scaled while in ASP) included.

    ``backward_passes_per_step`` > 1: as Horovod's, each call of ``apply_gradients`` adds the
    gradients to local sums; every N-th synchronizes the sums (divided by N if
    ``average_aggregated_gradients``) and applies them, the calls in between apply nothing and
    only advance ``iterations``.
    """
    options = checked_options(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
                              process_set=process_set, scale_local_gradients=scale_local_gradients,
                              backward_passes_per_step=backward_passes_per_step, strategy=strategy)
    check_sync_policy(optimizer, options.strategy)
    # Not the mixin's own __dict__/__weakref__ descriptors: they refuse the optimizer's instances, and Keras 3's
    # saving reads every object's __dict__ (model.save failed with a TypeError).
    methods = {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    # One plain object holding the bridges (Keras tracks the attributes it is given).
    wrapped._hybridsync = Bridges(options, allow_parameter_exchange=True,
                                  owner="hybridsync.tensorflow.keras.DistributedOptimizer",
                                  follower=lambda: SyncSwitchFollower(wrapped))
    wrapped._hybridsync_applying = False
    wrapped._hybridsync_aggregation = (None if backward_passes_per_step == 1 else
                                       LocalAggregation(backward_passes_per_step, average_aggregated_gradients))
    return wrapped


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None, compression: Any = None,
               **options: Any) -> Any:
    """A saved Keras model whose optimizer is wrapped in ``DistributedOptimizer`` (``compression`` and
    ``options`` its arguments, ``strategy=`` included), as ``horovod.tensorflow.keras.load_model``: the
    saved optimizer's state is picked up for training on. ``tf.keras.optimizers``' classes are found by name;
    ``custom_optimizers``: other optimizer classes; ``custom_objects``: as Keras'."""
    def wrapping(cls: type) -> type:
        """A class (Keras 3 takes no function for an optimizer) whose ``from_config`` makes the wrapped one."""
        def from_config(_: type, config: dict, custom_objects: Any = None) -> Any:
            return DistributedOptimizer(cls.from_config(config), compression=compression, **options)
        return type(cls.__name__, (cls,), {"from_config": classmethod(from_config)})

    found = {name: cls for name, cls in vars(tf.keras.optimizers).items()
             if isinstance(cls, type) and issubclass(cls, tf.keras.optimizers.Optimizer)}
    found.update({cls.__name__: cls for cls in custom_optimizers or ()})
    objects = {alias: wrapping(cls) for name, cls in found.items() for alias in (name, name.lower())}
    objects.update(custom_objects or {})
    return tf.keras.models.load_model(filepath, custom_objects=objects)


_FROM_TENSORFLOW = {"init", "allreduce", "allgather", "broadcast", "broadcast_variables", "Compression", "Average",
                    "Sum", "Adasum"}


def __getattr__(name: str) -> Any:
    """``hybridsync.tensorflow``'s functions (``init``, ``rank``, ``size``, ``allreduce``...) here too, as
    ``horovod.tensorflow.keras`` has Horovod's: a script that imports it as ``hvd`` calls ``hvd.init()``."""
    import hybridsync.tensorflow as hst
    from hybridsync.frameworks import HOROVOD_PROCESS_FUNCTIONS
    if name in _FROM_TENSORFLOW or name in HOROVOD_PROCESS_FUNCTIONS:
        return getattr(hst, name)
    raise AttributeError(f"module 'hybridsync.tensorflow.keras' has no attribute {name!r}")


__all__ = ["DistributedOptimizer", "callbacks", "load_model"]
