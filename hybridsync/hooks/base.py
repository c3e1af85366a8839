"""The step-hook interface: what rides along a training step, and how a hook ends the run."""
from __future__ import annotations

import os
import sys
from typing import NoReturn, Protocol, runtime_checkable


@runtime_checkable
class StepHook(Protocol):
    """Called by ``DistributedOptimizer`` at three moments of every step, in the order it holds them.

    A hook class may subclass this Protocol to inherit the moments it does not need, which do nothing.
    """

    def before_sync(self) -> None:
        """This rank's backward pass is done: its gradients are about to be synchronized."""

    def before_step(self) -> None:
        """The gradients are synchronized: the wrapped optimizer's update comes next."""

    def after_step(self) -> bool:
        """The update is done. ``True``: the run is over (the front end ends the process), else ``False``."""
        return False


def end_run(*, from_tensorflow_graph: bool = False) -> NoReturn:
    """End this process because a step hook finished the run (a profile written, a trial schedule
    done): output flushed, exit code 0. Called by the front end, never by a hook.

    ``SystemExit(0)``, so the script's ``finally`` blocks and ``atexit`` handlers run; inside a
    TensorFlow graph's ``numpy_function`` (``from_tensorflow_graph``), where ``SystemExit`` would
    become a TensorFlow error, the process ends at once instead.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if from_tensorflow_graph:
        os._exit(0)
    raise SystemExit(0)
