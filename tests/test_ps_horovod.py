"""PS route next to Horovod all-reduce in the same worker processes (horovodrun -np 2 --gloo).

The workers (``tests/workers/ps_with_ring.py``) submit some messages to the parameter
servers and the others to Horovod's ring, in opposite orders on the two ranks, and wait in
yet another order; every PS result must equal Horovod's all-reduce of the same tensors.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hybridsync.run.procs import run_bounded, start, stop

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "ps_with_ring.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(85)]


def test_ps_and_ring_in_one_step_match_allreduce(tmp_path):
    pytest.importorskip("horovod.torch")
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(PYTHONPATH=str(REPO), DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="2", DMLC_PS_ROOT_URI="127.0.0.1",
               DMLC_PS_ROOT_PORT=str(port), BYTEPS_PARTITION_BYTES="8000")
    servers = [start([sys.executable, "-m", "hybridsync.backends.ps.server", "--join-timeout", "60"],
                     env={**env, "DMLC_ROLE": "server", "DMLC_SERVER_ID": str(i)}, cwd=str(REPO)) for i in range(2)]
    try:
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        proc = run_bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(WORKER),
                            str(tmp_path / "out")], timeout=75, env={**env, "DMLC_ROLE": "worker"}, cwd=str(REPO))
        assert proc.returncode == 0, proc.stdout[-4000:]
        results = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(2)]
        assert [r["worker"] for r in results] == [0, 1]
        assert all(r["max_error"] < 1e-6 for r in results), results
        for server in servers:
            server.wait(timeout=20)
            assert server.returncode == 0
    finally:
        for server in servers:
            if server.poll() is None:
                stop(server, grace=2.0)
