"""Starting and stopping child processes so that none outlives its owner.

Every job hybridsync (or a test) starts runs in its own process session; stopping it
signals that whole group by the child's pid, first politely, then with SIGKILL.

A session of its own also means the terminal's signals and the owner's death no longer
reach the child: when the owner is killed (even by SIGKILL, which runs no cleanup), the
child gets SIGTERM from the kernel instead (Linux's parent-death signal, set in the child
before it executes the command: ``hybridsync.children.die_with_parent``). What the child
started in turn it stops itself: horovodrun stops its ranks on SIGTERM (and its per-rank
middlemen stop them once horovodrun is gone), mpirun stops its ranks on SIGTERM, a rank
started directly has the signal too.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence

from hybridsync.children import die_with_parent


def start(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
          capture: bool = True) -> subprocess.Popen:
    """Start ``argv`` in a new session (its own process group) so it can be stopped whole; it
    gets SIGTERM if this process dies (``die_with_parent``)."""
    out = subprocess.PIPE if capture else None
    return subprocess.Popen(list(argv), env=dict(env) if env is not None else None, cwd=cwd,
                            stdout=out, stderr=subprocess.STDOUT if capture else None, text=True,
                            start_new_session=True, preexec_fn=die_with_parent())


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop ``proc`` and everything in its process group: SIGTERM, then SIGKILL after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                # The leader is gone; make sure nothing it left in the group survives.
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_bounded(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` to completion or ``timeout`` seconds, whichever first; output captured.

    On timeout the whole process group is stopped and ``subprocess.TimeoutExpired`` is
    raised with the output gathered so far.
    """
    proc = start(argv, env=env, cwd=cwd)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stop(proc)
        output, _ = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, output=output) from e
    finally:
        if proc.poll() is None:
            stop(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, output, None)
