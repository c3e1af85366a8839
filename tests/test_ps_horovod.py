"""PS route next to Horovod all-reduce in the same worker processes (horovodrun -np 2 --gloo).

The workers submit some messages to the parameter servers and the others to Horovod's
ring, in opposite orders on the two ranks, and wait in yet another order; every PS result
must equal Horovod's all-reduce of the same tensors. This file is also the worker program.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker_main(out: Path) -> int:
    import horovod.torch as hvd
    import torch
    from hybridsync.backends import ps
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ring import RingAllreduce
    hvd.init()
    client = ps.init()  # DMLC_WORKER_ID falls back to HOROVOD_RANK
    backends = {"ps": ps.PSBackend(client), "ring": RingAllreduce()}
    errors, rank = [], hvd.rank()
    for step in range(3):
        tensors = {f"m{i}": torch.randn(1000 * (i + 1), generator=torch.Generator().manual_seed(10 * rank + step + i))
                   for i in range(6)}
        expected = {name: hvd.allreduce(t.clone(), name=f"check.{name}", op=hvd.Average) for name, t in tensors.items()}
        names = sorted(tensors) if rank == 0 else sorted(tensors, reverse=True)
        handles = {name: backends["ps" if int(name[1]) % 2 == 0 else "ring"].submit(name, [tensors[name]], Reduction())
                   for name in names}
        for name in sorted(handles, key=lambda n: (int(n[1]) * 7 + rank) % 6):
            handles[name].wait()
        errors += [float((tensors[n] - expected[n]).abs().max()) for n in tensors]
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"max_error": max(errors), "worker": client.config.index}))
    ps.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(worker_main(Path(sys.argv[1])))


import pytest  # noqa: E402

from hybridsync.run.procs import run_bounded, start, stop  # noqa: E402

pytestmark = pytest.mark.timeout(85)


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
        proc = run_bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__,
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
