"""The synchronization options of a tape or a Keras optimizer, checked once: Horovod's arguments
as ``SyncOptions`` (``hybridsync.horovod_options``), with what TensorFlow adds and refuses."""
from __future__ import annotations

from typing import Any

from hybridsync.horovod_options import SyncOptions


def checked_options(*, compression: Any, **horovod_arguments: Any) -> SyncOptions:
    """``SyncOptions.checked`` of a TensorFlow front end's arguments: Horovod TensorFlow's compressors
    become hybridsync's, and lists of variables in ``groups`` are checked once mirrored. (What a
    front end cannot run is refused by it: the tape, ``refuse_dynamic_sync``; the Keras optimizer,
    ``keras.syncswitch.check_sync_policy``.)"""
    return SyncOptions.checked(compression=_compression(compression), check_members=False, **horovod_arguments)


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
