"""Children that end with their parent: Linux's parent-death signal, armed before exec.

A child started in a session of its own (so that it can be stopped whole, and the terminal's
signals reach only its owner) no longer dies with its owner: a launcher killed by SIGKILL runs
no cleanup, and its children would run on. With ``preexec_fn=die_with_parent()`` the kernel
sends the child a signal when its starter dies. A leaf module: the launchers (``run/``), the
emulated cluster (``cluster/``) and the trial runner all use it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Any:
    """libc's ``prctl``, looked up once (in the parent: nothing is loaded between fork and exec)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: children end only when their owner stops them


_PRCTL = _prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when the thread that started it ends (its
    parent process dies, however); ``None`` where the platform has no parent-death signal.

    The kernel ties the signal to the starting *thread*: start children from a thread that
    lives as long as they should (hybridsync's launchers start them from the main thread).
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    return preexec
