"""The synchronization options of a tape or a Keras optimizer, checked once: Horovod's arguments
as ``SyncOptions`` (``hybridsync.horovod_options``), with what TensorFlow adds and refuses."""
from __future__ import annotations

from typing import Any

from hybridsync.horovod_options import SyncOptions


def checked_options(*, compression: Any, **horovod_arguments: Any) -> SyncOptions:
    """``SyncOptions.checked`` of a TensorFlow front end's arguments: Horovod TensorFlow's compressors
    become hybridsync's, lists of variables in ``groups`` are checked once mirrored, and a strategy
    whose ``sync`` policy switches protocols in flight is refused."""
    options = SyncOptions.checked(compression=_compression(compression), check_members=False, **horovod_arguments)
    refuse_dynamic_sync(options.strategy)
    return options


def with_strategy(options: SyncOptions, strategy: Any) -> SyncOptions:
    """``options`` under another strategy (resolved as ``strategy=`` is), refused as ``checked_options`` does."""
    options = options.with_strategy(strategy)
    refuse_dynamic_sync(options.strategy)
    return options


def refuse_dynamic_sync(strategy: Any) -> None:
    """``ValueError`` for a strategy whose ``sync`` policy switches protocols in flight (``switch``,
    ``elastic``): Sync-Switch scales the optimizer's learning rate and momentum at each switch,
    which hybridsync can do only for torch optimizers."""
    sync = getattr(strategy, "sync", None)
    if sync is not None and sync.dynamic:
        raise ValueError(f"the strategy's `sync` policy {sync.policy!r} switches protocols in flight and scales the "
                         f"optimizer's learning rate and momentum, which hybridsync can only do for torch "
                         f"optimizers; use a static protocol (bsp, asp, ssp) with TensorFlow")


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
