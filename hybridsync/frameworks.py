"""Optional frameworks, imported where needed with an error that says how to get them, and the
names of Horovod's that hybridsync's front ends (``hybridsync``, ``hybridsync.tensorflow``) offer.

Torch-free and Horovod-free: ``import hybridsync`` works where neither is installed.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# Horovod's reduce-op constants (horovod.common.basics), so hs.Average == hvd.Average.
Average = 0
Sum = 1
Adasum = 2

HOROVOD_PROCESS_FUNCTIONS = frozenset({
    "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "broadcast_object", "allgather_object", "join", "barrier", "mpi_enabled", "gloo_enabled", "mpi_built",
    "gloo_built", "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "HorovodInternalError",
})
"""``horovod.torch``'s names that both front ends pass through as they are (processes, objects,
process sets): hybridsync's runtime runs on Horovod's PyTorch core, also under TensorFlow."""
HOROVOD_TORCH_FUNCTIONS = frozenset({
    "init", "broadcast_parameters", "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_",
})
"""``horovod.torch``'s tensor collectives and ``init``, passed through by ``hybridsync`` only
(``hybridsync.tensorflow`` has its own, on TensorFlow tensors)."""


def check_op(op: int) -> None:
    """``ValueError`` for a reduce op hybridsync does not run (Adasum, or not an op at all)."""
    if op not in (Average, Sum):
        raise ValueError(f"op {op!r} is not supported by hybridsync (use Average or Sum)")


def horovod_torch(feature: str) -> ModuleType:
    """``horovod.torch``, or an ``ImportError`` naming ``feature`` and the install command."""
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as e:
        raise ImportError(f"{feature} needs horovod.torch, which does not import here: {e}. "
                          f"Run `make test` (or scripts/bootstrap.sh) to install it.") from e


def versions() -> dict[str, str]:
    """Versions of what a measured time depends on: torch, Horovod (if it imports), hybridsync and
    its runtime revision (``version.RUNTIME_REVISION``: which stored trials still measure what runs)."""
    import torch

    from hybridsync.version import RUNTIME_REVISION, __version__
    out = {"torch": torch.__version__, "hybridsync": __version__, "runtime": str(RUNTIME_REVISION)}
    try:
        import horovod
        out["horovod"] = horovod.__version__
    except ImportError:
        pass
    return out
