"""The ranks of a calibration job: a seconds-long collective micro-benchmark on a cluster.

    python -m hybridsync.trials.calibration_worker --results R.json [--sizes 4 65536 1048576 4194304]

Started on every rank by ``hybridsync.model.calibration`` through the same job targets as
the trials (the emulated cluster, or real hosts through ``hybridsync-run``, servers
included), before an autotune's first search. It times, on the job's own ranks, each op
between barriers, the slowest rank's time per repeat, paths in a rotated order per repeat
(so that noise hits them alike):

- ``ring``: Horovod all-reduce of one float32 tensor of each size (bytes);
- ``hier``: hybridsync's hierarchical all-reduce of the same (skipped where the route is
  unavailable);
- ``ps``: a BSP push-pull of the same through the job's parameter servers (keys balanced as
  the router places them; skipped without servers), and ``ps_burst``: ``BURST`` small keys
  pushed at once, so that the cost of one more key in flight shows;
- ``cpu``: casting a tensor to float16 and back on every rank at once (fp16 compression's work).

Rank 0 writes one JSON document: the world (size, local size, cross size, servers) and, per
path and size, the seconds of every repeat. ``model.calibration.fit_links`` turns it into the
simulator's ``LinkConstants``. Any error: written to stderr, the rank exits non-zero.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

from hybridsync import envvars

DEFAULT_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Message bytes: a latency probe and three sizes up to a PS key (4 MiB at 250 Mbit/s: ~0.2 s)."""
BURST = 16
"""Keys pushed at once by ``ps_burst``."""
BURST_BYTES = 4096
CPU_BYTES = 4 * 1024 * 1024


def _timed(hvd: Any, op: Callable[[], None]) -> float:
    from hybridsync.backends import waiting
    waiting.barrier(hvd, "calibration.barrier")
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _paths(hvd: Any, sizes: list[int]) -> dict[str, Callable[[int], Callable[[], None]]]:
    """Per available path, a maker of its op for a message of ``nbytes`` (tensors made once)."""
    import torch

    from hybridsync.backends import Reduction, RouteUnavailableError, make_backend
    total = Reduction(op="sum")
    tensors = {nbytes: torch.ones(max(nbytes // 4, 1)) for nbytes in sizes}
    paths: dict[str, Callable[[int], Callable[[], None]]] = {}
    ring = make_backend("allreduce", "ring")
    paths["ring"] = lambda n: lambda: ring.submit(f"calibration.ring.{n}", [tensors[n]], total).wait()
    try:
        hier = make_backend("allreduce", "hierarchical")
        paths["hier"] = lambda n: lambda: hier.submit(f"calibration.hier.{n}", [tensors[n]], total).wait()
    except RouteUnavailableError as error:
        if hvd.rank() == 0:
            print(f"calibration: no hierarchical path ({error})", flush=True)
    if os.environ.get(envvars.DMLC_NUM_SERVER, "0") not in ("", "0"):
        ps = make_backend("ps", "bsp", namespace="calibration")
        burst = [torch.ones(BURST_BYTES // 4) for _ in range(BURST)]
        # the burst's keys first, on their own, so that they spread over every server (declared
        # after the large messages, they would all go to the server those left least loaded)
        ps.declare_all([(f"burst.{k}", (t,), None) for k, t in enumerate(burst)])
        ps.declare_all([(f"ps.{n}", (tensors[n],), None) for n in sizes])
        paths["ps"] = lambda n: lambda: ps.submit(f"ps.{n}", [tensors[n]], total).wait()

        def push_burst() -> None:
            for handle in [ps.submit(f"burst.{k}", [t], total) for k, t in enumerate(burst)]:
                handle.wait()
        paths["ps_burst"] = lambda n: push_burst
    return paths


def measure(hvd: Any, sizes: list[int], repeats: int) -> dict[str, dict[int, list[float]]]:
    """Per path and size, this rank's seconds of each repeat (after one warm-up of each)."""
    paths = _paths(hvd, sizes)
    ops = [(path, n) for path in paths for n in (sizes if path != "ps_burst" else [BURST * BURST_BYTES])]
    seconds: dict[str, dict[int, list[float]]] = {path: {} for path in paths}
    for path, n in ops:
        _timed(hvd, paths[path](n))
    for r in range(repeats):
        for path, n in ops[r % len(ops):] + ops[:r % len(ops)]:
            seconds[path].setdefault(n, []).append(_timed(hvd, paths[path](n)))
    return seconds


def cpu_seconds(repeats: int) -> list[float]:
    """Seconds to cast ``CPU_BYTES`` of float32 to float16 and back, on this rank."""
    import torch
    tensor = torch.ones(CPU_BYTES // 4)
    out = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        tensor.half().float()
        out.append(time.perf_counter() - start)
    return out[1:]


def run(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import numpy as np
    import torch

    import hybridsync as hs
    from hybridsync.backends import waiting
    hs.init()
    torch.set_num_threads(1)
    mine = measure(hvd, args.sizes, args.repeats)
    waiting.barrier(hvd, "calibration.cpu")
    cpu = cpu_seconds(args.repeats)
    # a rank's cast time: its lower quartile (other jobs only ever slow a cast down); the job's: the median rank's
    everyone = hvd.allgather_object({"paths": mine, "cpu": float(np.quantile(cpu, 0.25))}, name="calibration.gather")
    if hvd.rank() == 0:
        paths = {path: {str(n): [max(rank["paths"][path][n][i] for rank in everyone) for i in range(len(times))]
                        for n, times in by_size.items()} for path, by_size in mine.items()}
        doc = {"world": {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
                         "num_servers": int(os.environ.get(envvars.DMLC_NUM_SERVER, "0") or 0)},
               "repeats": args.repeats, "burst": {"keys": BURST, "bytes": BURST_BYTES}, "paths": paths,
               "cpu": {"bytes": CPU_BYTES, "seconds": statistics.median(rank["cpu"] for rank in everyone)}}
        partial = f"{args.results}.partial"
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(doc, handle)
        os.replace(partial, args.results)
    waiting.barrier(hvd, "calibration.done")
    if "ps" in mine:
        from hybridsync.backends import ps
        ps.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridsync.trials.calibration_worker",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--results", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message bytes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(n < 4 for n in args.sizes):
        parser.error("need --repeats >= 1 and --sizes of at least 4 bytes")
    return args


if __name__ == "__main__":
    run(parse_args())
