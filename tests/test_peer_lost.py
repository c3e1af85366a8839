"""A script ended by a lost peer (``hybridsync.backends.peer_lost``) exits at once, losing nothing.

A child interpreter raises a ``PeerLostError`` subclass (or an error raised from one) out of its
script: its traceback is printed, its buffered output flushed, its non-daemon thread finished and
its exit handlers run, and it exits 1; an unrelated error ends the usual way. That the exit skips
Horovod's shutdown on a cut link (~20 s sooner) is measured on real jobs by
``tests/test_netfault_emulated.py``.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from hybridsync.backends.hierarchical.liveness import PeerUnreachableError
    from hybridsync.backends.ps.recovery import PSServerError

    atexit.register(lambda: print("exit handler ran"))
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
    print("buffered line")  # stdout is a pipe: block-buffered until flushed
    kind = sys.argv[1]
    if kind == "unreachable":
        raise PeerUnreachableError("rank 2 on node 1 has not answered")
    if kind == "wrapped":
        try:
            raise PSServerError("parameter server server1 is gone")
        except PSServerError as error:
            raise ValueError("the user's own error") from error
    raise ValueError("unrelated")
""")


def _run(kind: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("kind, last_line", [
    ("unreachable", "PeerUnreachableError: rank 2 on node 1 has not answered"),
    ("wrapped", "ValueError: the user's own error"),
    ("unrelated", "ValueError: unrelated"),
])
def test_the_exit_keeps_the_traceback_output_threads_and_handlers(kind, last_line):
    done = _run(kind)
    assert done.returncode == 1, done
    assert done.stderr.strip().splitlines()[-1].endswith(last_line), done.stderr
    assert done.stdout.splitlines() == ["buffered line", "thread finished", "exit handler ran"], done
