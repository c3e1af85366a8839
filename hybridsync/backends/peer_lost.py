"""Errors that mean the job lost a peer, and a prompt exit when one ends the script.

A rank whose route found a peer gone (``PeerUnreachableError``: the network between the nodes
cut; ``PSServerError``: a parameter server gone; ``PeerExitedError``: a rank of the node exited)
raises within seconds, but its process used to end ~20 s later: Python's exit runs Horovod's
``shutdown`` (an ``atexit`` handler), which joins Horovod's background thread, and that thread
sits in Horovod's own Gloo collective on the dead link until ``HOROVOD_GLOO_TIMEOUT_SECONDS``
(30 s; with 60 s the job ended 64 s after a cut: benchmarks/netfault.py). Nothing is left to
synchronize by then: the job cannot continue.

So the first ``PeerLostError`` created in a process installs a ``sys.excepthook`` that, for an
uncaught exception that is (or was raised from, or while handling) a ``PeerLostError``: prints
the traceback as Python would, runs the process's exit handlers except Horovod's shutdown (the
script's own, hybridsync's ``/dev/shm`` and PS clean-up, ``logging``'s), flushes the output and
ends the process with exit code 1 without the rest of the interpreter's shutdown (whose C++
destructors would join the same thread). The script's non-daemon threads are waited for first, as
Python's exit waits for them. Any other uncaught exception, a normal exit, and a process that
never saw a ``PeerLostError`` end exactly as before.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import types
from typing import Callable, NoReturn

from hybridsync.failure_notes import causes

_HOROVOD_FRONT_ENDS = ("horovod.torch.mpi_ops", "horovod.tensorflow.mpi_ops")
"""Horovod's front ends: each has a ``shutdown`` and a ``_basics`` (``HorovodBasics``)."""


class PeerLostError(RuntimeError):
    """A peer of this rank (another rank, a parameter server) or the network to it is gone: the job
    cannot continue. Creating one arms the prompt exit (module docstring)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        arm_prompt_exit()


_previous_hook: Callable[..., object] | None = None
_exiting = False


def exiting() -> bool:
    """Whether this process is ending because a lost peer ended its script (its exit handlers are
    running): a handler may skip waiting on connections the process's exit closes anyway."""
    return _exiting


def arm_prompt_exit() -> None:
    """Install ``exit_promptly_on_peer_lost`` as ``sys.excepthook`` (once; it defers to the hook it replaced)."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = exit_promptly_on_peer_lost


def is_peer_lost(error: BaseException | None) -> bool:
    """Whether ``error`` is a ``PeerLostError`` or came from one (``raise ... from``, or raised while handling one)."""
    return any(isinstance(cause, PeerLostError) for cause in causes(error))


def exit_promptly_on_peer_lost(kind: type[BaseException], error: BaseException,
                               trace: types.TracebackType | None) -> None:
    """``sys.excepthook``: a lost peer ends the process now (module docstring); anything else as before."""
    previous = _previous_hook or sys.__excepthook__
    previous(kind, error, trace)
    if not is_peer_lost(error):
        return
    global _exiting
    _exiting = True
    for shutdown in _horovod_shutdowns():
        atexit.unregister(shutdown)
    # What Python's exit does, in its order: wait for the script's non-daemon threads (a checkpoint
    # being written), then run the exit handlers (the script's, hybridsync's clean-up, logging's
    # flush; each handler's error is printed and the next one runs).
    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    flush_and_exit(1)


def flush_and_exit(code: int) -> NoReturn:
    """End this process with ``code`` at once (no interpreter shutdown), its output flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _horovod_shutdowns() -> list[Callable[[], None]]:
    """Horovod's ``shutdown`` handlers of the front ends this process imported: ``HorovodBasics.shutdown``
    (``hvd.init()`` registers it) and the front end's own ``shutdown`` (hybridsync's PS route
    registers ``hvd.shutdown``, which wraps it in horovod.torch)."""
    modules = [module for name in _HOROVOD_FRONT_ENDS if (module := sys.modules.get(name)) is not None]
    return [function for module in modules
            for function in (getattr(module, "shutdown", None), getattr(getattr(module, "_basics", None), "shutdown", None))
            if function is not None]
