"""Parameter-server push-pull vs Horovod all-reduce of the same bytes, in the same job.

    .venv/bin/python benchmarks/ps.py      # starts 2 PS servers, then 2 workers under horovodrun --gloo

Each worker does, interleaved per round, a Horovod all-reduce and a BSP push-pull
(2 servers, BYTEPS_PARTITION_BYTES chunks) of 4, 16 and 64 MB of float32, and reports
the median time of each, their ratio (ps / allreduce) and the payload bytes each worker
sent. The sparse case pushes a 1M-row x 16 embedding gradient with 1% of rows touched:
touched rows only on the PS route, compared with the dense gradient's size.
Numbers come from one loopback host; all four processes share its cores.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

SIZES_MB = (4, 16, 64)
ROUNDS = int(os.environ.get("PS_BENCH_ROUNDS", "5"))
EMBEDDING_ROWS, EMBEDDING_DIM, TOUCHED = 1_000_000, 16, 0.01


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dense_case(hvd, backend, client, megabytes: int) -> dict:
    """Median seconds of all-reduce and push-pull of ``megabytes`` MB, and PS bytes sent per call."""
    import torch
    from hybridsync.backends.base import Reduction
    tensor = torch.ones(megabytes * 2**20 // 4)
    name = f"dense{megabytes}"
    backend.declare(name, [tensor])
    allreduce = lambda: hvd.allreduce_(tensor, name=name, op=hvd.Sum)  # noqa: E731
    push_pull = lambda: backend.submit(name, [tensor], Reduction(op="sum")).wait()  # noqa: E731
    allreduce(), push_pull()  # warm-up: connections, buffers
    times: dict[str, list[float]] = {"allreduce": [], "ps": []}
    for r in range(ROUNDS):
        for kind in (("allreduce", "ps") if r % 2 == 0 else ("ps", "allreduce")):
            hvd.barrier()
            times[kind].append(timed(allreduce if kind == "allreduce" else push_pull))
    sent_before = client.counters.pushed_bytes
    push_pull()
    return {"mb": megabytes, "allreduce_s": statistics.median(times["allreduce"]),
            "ps_s": statistics.median(times["ps"]), "ps_bytes_sent": client.counters.pushed_bytes - sent_before}


def sparse_case(hvd, backend, client) -> dict:
    """Bytes one worker sends for a 1%-touched embedding gradient, and the round-trip time."""
    import torch
    from hybridsync.backends.base import Reduction
    emb = torch.nn.Embedding(EMBEDDING_ROWS, EMBEDDING_DIM, sparse=True)
    rows = torch.randperm(EMBEDDING_ROWS, generator=torch.Generator().manual_seed(hvd.rank()))
    emb(rows[:int(EMBEDDING_ROWS * TOUCHED)]).sum().backward()
    grad = emb.weight.grad
    backend.submit_sparse("embedding", grad, Reduction(op="sum"))()  # warm-up
    sent_before = client.counters.pushed_bytes
    hvd.barrier()
    seconds = timed(lambda: backend.submit_sparse("embedding", grad, Reduction(op="sum"))())
    return {"rows": EMBEDDING_ROWS, "touched": TOUCHED, "ps_s": seconds,
            "ps_bytes_sent": client.counters.pushed_bytes - sent_before, "dense_bytes": emb.weight.nbytes}


def worker() -> None:
    import horovod.torch as hvd
    import torch
    from hybridsync.backends import ps
    hvd.init()
    torch.set_num_threads(1)
    client = ps.init(worker_id=hvd.rank())
    backend = ps.PSBackend(client)
    dense = [dense_case(hvd, backend, client, mb) for mb in SIZES_MB]
    sparse = sparse_case(hvd, backend, client)
    hvd.barrier()
    ps.shutdown()
    if hvd.rank() == 0:
        report(dense, sparse)


def report(dense: list[dict], sparse: dict) -> None:
    print(f"2 workers (horovodrun --gloo) + 2 PS servers, loopback, median of {ROUNDS} interleaved rounds")
    print(f"{'size':>6} {'allreduce':>11} {'ps push_pull':>13} {'ps/allreduce':>13} {'PS MB sent/worker':>18}")
    for row in dense:
        print(f"{row['mb']:>4}MB {row['allreduce_s'] * 1e3:>9.1f}ms {row['ps_s'] * 1e3:>11.1f}ms "
              f"{row['ps_s'] / row['allreduce_s']:>13.2f} {row['ps_bytes_sent'] / 2**20:>18.2f}")
    print(f"sparse: {sparse['rows']} x {EMBEDDING_DIM} embedding, {sparse['touched']:.0%} rows touched: "
          f"{sparse['ps_bytes_sent'] / 2**20:.2f} MB sent per worker vs {sparse['dense_bytes'] / 2**20:.1f} MB "
          f"dense ({sparse['dense_bytes'] / sparse['ps_bytes_sent']:.0f}x less), push_pull {sparse['ps_s'] * 1e3:.1f} ms")
    print("json:", json.dumps({"dense": dense, "sparse": sparse}))


def main() -> None:
    if os.environ.get("HOROVOD_RANK") is not None:
        worker()
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, repo)
    import socket
    from hybridsync.run.procs import run_bounded, start, stop
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": repo, "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port)}
    servers = [start([sys.executable, "-m", "hybridsync.backends.ps.server"], capture=False,
                     env={**env, "DMLC_ROLE": "server", "DMLC_SERVER_ID": str(i)}) for i in range(2)]
    try:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        proc = run_bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                            os.path.abspath(__file__)], timeout=600, env={**env, "DMLC_ROLE": "worker"})
        print(proc.stdout)
    finally:
        for server in servers:
            stop(server, grace=10.0)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
