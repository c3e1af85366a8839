"""The synchronization options a tape or a Keras optimizer was given, checked once."""
from __future__ import annotations

import dataclasses
from typing import Any

from hybridsync.frameworks import horovod_torch
from hybridsync.strategy import resolve_strategy


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Horovod's arguments of ``DistributedGradientTape`` / ``DistributedOptimizer``, plus the strategy."""

    compression: Any
    """``hybridsync.tensorflow.Compression.none``/``fp16`` (Horovod's TensorFlow classes are accepted by name)."""
    sparse_as_dense: bool
    op: int
    gradient_predivide_factor: float
    groups: Any
    """Horovod's ``groups``: a count, lists of variables, or ``None``."""
    process_set: Any
    scale_local_gradients: bool
    backward_passes_per_step: int
    strategy: Any
    """The resolved ``Strategy`` (from ``strategy=`` or ``HYBRIDSYNC_STRATEGY``), or ``None``."""

    @classmethod
    def checked(cls, *, compression: Any, sparse_as_dense: bool, op: int, gradient_predivide_factor: float,
                num_groups: int, groups: Any, process_set: Any, scale_local_gradients: bool,
                backward_passes_per_step: int, strategy: Any) -> "SyncOptions":
        """The options, with the mistakes Horovod refuses (and a bad strategy) refused now, not at the first step."""
        from hybridsync.horovod_options import normalize_groups
        from hybridsync.optimizer import check_arguments
        check_arguments(op, gradient_predivide_factor, backward_passes_per_step)
        groups = groups if isinstance(groups, list) else normalize_groups(groups, num_groups)
        strategy = resolve_strategy(strategy)
        return cls(compression=_compression(compression), sparse_as_dense=sparse_as_dense, op=op,
                   gradient_predivide_factor=gradient_predivide_factor, groups=groups, process_set=process_set,
                   scale_local_gradients=scale_local_gradients, backward_passes_per_step=backward_passes_per_step,
                   strategy=strategy)

    def with_strategy(self, strategy: Any) -> "SyncOptions":
        """The same options under another strategy (resolved as ``strategy=`` is)."""
        strategy = resolve_strategy(strategy)
        return dataclasses.replace(self, strategy=strategy)

    def size(self) -> int:
        """Ranks that synchronize: the process set's, else the job's."""
        if self.process_set is not None:
            return self.process_set.size()
        return horovod_torch("hybridsync.tensorflow").size()


def refuse_dynamic_sync(strategy: Any) -> None:
    """``ValueError`` for a strategy whose ``sync`` policy switches protocols in flight (``switch``,
    ``elastic``) given to a gradient tape: Sync-Switch runs ASP and scales the optimizer's learning
    rate at each switch, and a tape sees neither the update nor the optimizer."""
    sync = getattr(strategy, "sync", None)
    if sync is not None and sync.dynamic:
        raise ValueError(f"DistributedGradientTape: the strategy's `sync` policy {sync.policy!r} switches the "
                         f"parameter server's variables to ASP in flight and scales the optimizer's learning rate, "
                         f"and a gradient tape sees neither the update nor the optimizer. Use "
                         f"hybridsync.tensorflow.keras.DistributedOptimizer (it also serves custom loops through "
                         f"apply_gradients), or a static protocol (bsp, asp, ssp) with the tape")


def _compression(compression: Any) -> Any:
    """hybridsync's compressor for ``compression``: ours as given, Horovod TensorFlow's by its class name."""
    from hybridsync.compression import Compression
    if compression is None:
        return Compression.none
    if isinstance(compression, type) and compression.__module__.startswith("horovod.tensorflow"):
        known = {"NoneCompressor": Compression.none, "FP16Compressor": Compression.fp16}
        if compression.__name__ not in known:
            raise ValueError(f"compression {compression.__name__} from horovod.tensorflow has no hybridsync "
                             f"equivalent (use Compression.none or Compression.fp16)")
        return known[compression.__name__]
    return compression
