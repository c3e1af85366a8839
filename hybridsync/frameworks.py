"""Optional frameworks, imported where needed with an error that says how to get them."""
from __future__ import annotations

import importlib
from types import ModuleType


def horovod_torch(feature: str) -> ModuleType:
    """``horovod.torch``, or an ``ImportError`` naming ``feature`` and the install command."""
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as e:
        raise ImportError(f"{feature} needs horovod.torch, which does not import here: {e}. "
                          f"Run `make test` (or scripts/bootstrap.sh) to install it.") from e


def versions() -> dict[str, str]:
    """Versions of what a measured time depends on: torch, Horovod (if it imports), hybridsync."""
    import torch

    from hybridsync.version import __version__
    out = {"torch": torch.__version__, "hybridsync": __version__}
    try:
        import horovod
        out["horovod"] = horovod.__version__
    except ImportError:
        pass
    return out
