"""A PS worker whose hand-started server 0 hangs before the workers start (real processes).

Server 0 (unsupervised) hosts the rendezvous store; stopped with SIGSTOP, it still accepts
connections in the kernel but never answers. Before: the worker waited the store's 120 s and
then the join's 120 s with no message. Now it says what it waits for while it waits, and fails
naming server 0 and its address once ``HYBRIDSYNC_PS_JOIN_TIMEOUT`` has passed.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from conftest import BIN, REPO
from hybridsync.run.procs import start, stop

pytestmark = pytest.mark.multiprocess

WORKER = """
import time
from hybridsync.backends import ps
start = time.monotonic()
print("joining", flush=True)
try:
    ps.init(worker_id=0)
except RuntimeError as e:
    print(f"FAILED after {time.monotonic() - start:.1f} s: {e}", flush=True)
    raise SystemExit(3)
print("joined", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def test_worker_names_a_stopped_server0_within_the_join_timeout():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port)})
    server = start([str(BIN / "hybridsync-server")], env={**env, "DMLC_ROLE": "server", "DMLC_SERVER_ID": "0"},
                   cwd=str(REPO))
    worker = None
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # server 0 hosts the store: it is up once the port listens
            assert server.poll() is None and time.monotonic() < deadline, "server 0 never listened"
            time.sleep(0.2)
        os.kill(server.pid, signal.SIGSTOP)
        worker = start([sys.executable, "-c", WORKER], cwd=str(REPO),
                       env={**env, "DMLC_ROLE": "worker", "HYBRIDSYNC_PS_JOIN_TIMEOUT": "8"})
        out, _ = worker.communicate(timeout=60)  # before: 240 s of silence
        assert worker.returncode == 3, out
        notices = [line for line in out.splitlines() if "still waiting" in line]
        assert len(notices) >= 2, out
        assert f"127.0.0.1:{port}" in notices[0] and "server0" in notices[0], notices[0]
        assert "accepts connections but does not answer" in notices[0], notices[0]
        failure = next(line for line in out.splitlines() if line.startswith("FAILED"))
        assert f"127.0.0.1:{port}" in failure and "server0" in failure and "within 8 s" in failure, failure
        assert float(failure.split()[2]) < 20, failure  # 8 s and the notice's last probe, not 240 s
    finally:
        for proc in (worker, server):
            if proc is not None and proc.poll() is None:
                stop(proc, grace=2.0)


def test_a_healthy_slow_start_prints_no_notice():
    """The servers come up 12 s after the worker began to wait for them (a busy machine, a slow
    scheduler): it joins without a word. Before, it printed "still waiting" at 10 s, which reads
    like a fault in a log where nothing went wrong; the notices now start at a quarter of the
    join timeout (60 s of this test's 240 s)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port)})
    worker = start([sys.executable, "-c", WORKER], cwd=str(REPO),
                   env={**env, "DMLC_ROLE": "worker", "HYBRIDSYNC_PS_JOIN_TIMEOUT": "240"})
    server = None
    try:
        early = []
        for line in worker.stdout:  # bounded: the worker prints it after its imports, or exits
            early.append(line)
            if line.strip() == "joining":
                break
        assert early and early[-1].strip() == "joining", "".join(early)
        time.sleep(12)
        server = start([str(BIN / "hybridsync-server")], env={**env, "DMLC_ROLE": "server", "DMLC_SERVER_ID": "0"},
                       cwd=str(REPO))
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0 and "joined" in out, out
        assert "still waiting" not in "".join(early) + out, out
    finally:
        for proc in (worker, server):
            if proc is not None and proc.poll() is None:
                stop(proc, grace=2.0)
