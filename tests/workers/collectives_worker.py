"""Run on every rank of an emulated cluster (launch_gloo) with PS servers beside it.

    python collectives_worker.py mixed OUT.json     # ring + hierarchical + PS in flight at once
    python collectives_worker.py fail               # rank 3 exits mid-job, the others block
    python collectives_worker.py large OUT.json     # hierarchical all-reduce of 64 MiB, exact sums
    python collectives_worker.py peer_dies          # rank 1 dies between two hierarchical all-reduces

``mixed``: each step submits one message to each of the three transports before waiting on
any, so they share the step the way a mixed strategy's messages do, and checks each result
against the true reduction (sum or average of every rank's distinct values). Rank 0 writes
the largest error per transport, the world shape and rank 0's uplink bytes to OUT.json.

``large``: hierarchical all-reduce (sum) of a 64 MiB float32 message, ``LARGE_REPS`` times,
plus an odd-sized float16 message (the fp16 compression's wire dtype) and a transposed
(non-contiguous) one, compared exactly
with the true sum: the values are small integers, exact in any summation order, distinct
per rank, repetition and element, so a contribution counted twice or a slice put in the
wrong place shows. (Horovod 0.28.1's Gloo reduce-scatter, which the backend used to start
with, got exactly this wrong here.) Rank 0 writes every rank's count of wrong elements.
"""
from __future__ import annotations

import json
import os
import sys
import time

import horovod.torch as hvd
import torch

import hybridsync as hs
from hybridsync.backends import ps
from hybridsync.backends.base import Reduction
from hybridsync.backends.hierarchical import HierarchicalAllreduce
from hybridsync.backends.ring import RingAllreduce

STEPS = 3
NUMEL = {"ring": 1000, "hier": 3001, "ps": 250_000}  # odd sizes: padding; ps: several keys
LARGE_NUMEL = 64 * 2**20 // 4  # 64 MiB of float32: the size at which reduce-scatter went wrong
LARGE_REPS = 3
IDLE_S = 90.0
"""peer_dies: how long node 1's ranks wait to be stopped; beyond the test's bound on the job."""
FP16_NUMEL = 100_003  # odd: padding
STRIDED_ROWS, STRIDED_NUMEL = 7, 7 * 14_287  # odd: padding


def rank_values(rank: int, step: int, numel: int) -> torch.Tensor:
    """Distinct values per rank, step and element, so a wrong or partial sum cannot pass."""
    return torch.arange(numel, dtype=torch.float32) * 1e-3 + (rank + 1) * (step + 1)


def true_result(step: int, numel: int, size: int, op: str) -> torch.Tensor:
    total = sum(rank_values(r, step, numel) for r in range(size))
    return total / size if op == "average" else total


def uplink_tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as handle:
        return int(handle.read())


def mixed(out_path: str) -> None:
    hs.init()
    client = ps.init(worker_id=hvd.rank())
    backends = {"ring": RingAllreduce(), "hier": HierarchicalAllreduce(), "ps": ps.PSBackend(client)}
    chunks = client.declare("m.ps", [torch.empty(NUMEL["ps"])])
    server_bytes = [sum(c.nbytes for c in chunks if client.server_of(c.key) == s)
                    for s in range(client.config.num_servers)]
    errors = {path: 0.0 for path in backends}
    tx_before = uplink_tx_bytes()
    for step in range(STEPS):
        op = "average" if step % 2 == 0 else "sum"
        tensors = {path: rank_values(hvd.rank(), step, n) for path, n in NUMEL.items()}
        handles = {path: backends[path].submit(f"m.{path}", [tensors[path]], Reduction(op=op))
                   for path in ("ps", "hier", "ring")}  # all in flight before any wait
        for path in ("ring", "hier", "ps"):
            handles[path].wait()
            expected = true_result(step, NUMEL[path], hvd.size(), op)
            errors[path] = max(errors[path], float((tensors[path] - expected).abs().max()))
    tx = uplink_tx_bytes() - tx_before
    hvd.barrier()
    ps.shutdown()
    if hvd.rank() == 0:
        world = {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}
        with open(out_path, "w") as handle:
            json.dump({"errors": errors, "world": world, "uplink_tx_bytes": tx,
                       "ps_server_bytes": server_bytes}, handle)
    hvd.shutdown()


def integer_values(rank: int, rep: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers, so sums are exact in any order (float16 keeps integers exact up to 2048 only)."""
    period = 200 if dtype == torch.float16 else 1000
    return (torch.arange(numel, dtype=torch.float64) % period + (rank + 1) * (rep + 1) * 7).to(dtype)


def count_wrong(backend: HierarchicalAllreduce, name: str, numel: int, dtype: torch.dtype, rep: int,
                strided: bool = False) -> int:
    """Sums one message through ``backend``; how many elements differ from the true sum on this rank.

    ``strided``: the message is a transposed (non-contiguous) view, which the shared-memory
    transport copies whole rather than by slice."""
    values = integer_values(hvd.rank(), rep, numel, dtype)
    tensor = values.view(STRIDED_ROWS, -1).t() if strided else values
    backend.submit(name, [tensor], Reduction(op="sum")).wait()
    expected = sum(integer_values(r, rep, numel, dtype).double() for r in range(hvd.size()))
    return int((values.double() != expected).sum())


def large(out_path: str) -> None:
    hs.init()
    backend = HierarchicalAllreduce()
    wrong = {"float32": [], "float16": [], "strided": []}
    for rep in range(LARGE_REPS):  # the same messages each rep, as a training step's are
        wrong["float32"].append(count_wrong(backend, "large", LARGE_NUMEL, torch.float32, rep))
        wrong["float16"].append(count_wrong(backend, "fp16", FP16_NUMEL, torch.float16, rep))
        wrong["strided"].append(count_wrong(backend, "strided", STRIDED_NUMEL, torch.float32, rep, strided=True))
    gathered = hvd.allgather_object(wrong, name="large.gather")
    if hvd.rank() == 0:
        world = {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}
        with open(out_path, "w") as handle:
            json.dump({"world": world, "wrong_per_rank": gathered, "numel": LARGE_NUMEL}, handle)
    hvd.shutdown()


def fail() -> None:
    hs.init()
    hvd.allreduce(torch.ones(10), name="before")
    if hvd.rank() == 3:
        # Dies as a crash does: sys.exit would run Horovod's shutdown first, which may still be
        # running when the others' failure makes the launcher kill it (exit -15, not 3).
        os._exit(3)
    hvd.allreduce(torch.ones(10), name="never")  # blocks: rank 3 is gone
    sys.exit(0)


def peer_dies() -> None:
    """Rank 1 exits, with status 0 (so the launcher does not end the job for it), after one
    hierarchical all-reduce through shared memory; rank 0, waiting for rank 1's input in the
    segment they share, must fail naming it (the test reads the log).

    Only node 0 starts the second all-reduce: on node 1, rank 3 would meet rank 1's closed
    sockets in their cross-node group and could end the job first. Node 1's ranks wait
    for the launcher to stop them (or give up after IDLE_S, which the test would notice)."""
    hs.init()
    backend = HierarchicalAllreduce()
    assert backend.intra_node == "shm", backend.intra_node
    tensor = torch.ones(1000)
    backend.submit("m.hier", [tensor], Reduction(op="sum")).wait()
    assert bool((tensor == hvd.size()).all())
    print(f"rank {hvd.rank()}: first all-reduce done", flush=True)
    if hvd.rank() == 1:
        os._exit(0)
    if hvd.cross_rank() == 0:
        backend.submit("m.hier", [tensor], Reduction(op="sum")).wait()
    else:
        time.sleep(IDLE_S)
    sys.exit(0)


if __name__ == "__main__":
    modes = {"mixed": lambda: mixed(sys.argv[2]), "large": lambda: large(sys.argv[2]), "fail": fail,
             "peer_dies": peer_dies}
    modes[sys.argv[1]]()
