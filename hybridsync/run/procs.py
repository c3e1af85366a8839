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
import time
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
    """Stop ``proc`` and everything in its process group: SIGTERM, then SIGKILL to what is left after
    ``grace`` s.

    The group gets the grace, not only its leader: a launcher in it cleans up after its ranks once they
    are gone (mpirun removes the ``/dev/shm`` segments of OpenMPI's shared-memory transport, which a
    killed rank cannot), and the leader is often a shell that dies at once. Killing the group as soon
    as the leader was gone left two 4 MB files in ``/dev/shm`` per interrupted job."""
    stop_all([proc], grace)


def stop_all(processes: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """``stop`` every one of ``processes`` at once: one grace for all of them, not one after another
    (a launcher's K parameter servers that each lingered took K graces)."""
    for proc in processes:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    waiting = list(processes)
    while waiting and time.monotonic() < deadline:
        for proc in waiting:
            proc.poll()  # reaps the leader, so that it does not count as a member
        waiting = [proc for proc in waiting if _group_alive(proc.pid)]
        if waiting:
            time.sleep(0.05)
    for proc in processes:
        _signal_group(proc.pid, signal.SIGKILL)
    wait_all(processes, time.monotonic() + grace)


def wait_all(processes: Sequence[subprocess.Popen], deadline: float) -> bool:
    """Wait until every one of ``processes`` has exited or ``time.monotonic()`` passes ``deadline``
    (past it, each is still polled, so that the exited ones are reaped); whether they all exited."""
    exited = True
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            exited = False
    return exited


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, left for another parent to reap, do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after "(comm)": state, ppid, pgrp
            return True
    return False


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
