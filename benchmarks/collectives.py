"""Ring vs hierarchical all-reduce vs parameter-server push-pull on an emulated 2 x 2 cluster (root).

    sudo .venv/bin/python benchmarks/collectives.py                    # 1gbit, 4/16/64 MB, 7 rounds
    sudo .venv/bin/python benchmarks/collectives.py --rounds 3 --sizes 4 16

Brings up 2 hosts (network namespaces) with 2 Horovod Gloo ranks and 1 PS server each,
uplinks shaped to ``--bandwidth`` (default 1 Gbit/s each way), and times, per message size:

- ring:  Horovod ring all-reduce of the whole message (``RingAllreduce``);
- hier:  hybridsync's ``HierarchicalAllreduce`` as a job gets it: within a host through
         shared memory (each rank sums its slice of everyone's message), all-reduce of each
         rank's slice across nodes, copy of the result out of shared memory;
- hier-gloo: the same with ``HYBRIDSYNC_INTRA_NODE=horovod``: Gloo all-reduce in node,
         all-reduce of each rank's slice across nodes, Gloo all-gather in node;
- ps:    BSP push-pull through the 2 servers (keys of ``--partition-mb``, placed balanced).

Each round runs the paths in a rotated order (so background noise hits all three
alike), each op between barriers; a rep's time is the slowest rank's. Median over rounds.

Bounds (beta terms only; S = message bytes, B = one host uplink in bytes/s, one direction):

- ring, n ranks in one ring:  2(n-1)/n * S / B. With ranks 0,1 on host 0 and 2,3 on host 1
  the ring crosses each uplink once per direction, carrying 2(n-1)/n * S each way.
- hier, N nodes: each of the L ranks of a node all-reduces a S/L shard with its peers on
  the other nodes, all at once: the uplink carries L * 2(N-1)/N * S/L = 2(N-1)/N * S each
  way (intra-node steps on loopback are not in the bound).
- ps, colocated servers (one per host), keys balanced (S/N per server), w workers per host,
  no local aggregation: a host's outbound link carries its workers' pushes to remote
  servers, w * S(N-1)/N, plus its server's pulls to remote workers, (N-1)w * S/N:
  2w(N-1)/N * S each way. (BytePS's colocated 2(N-1)/N * S/B assumes one worker process
  per host, i.e. w = 1.)

The alpha term is left out of the bounds; a 4-byte message's time is printed as alpha.
Rank 0 also counts its host's eth0 tx bytes around one rep of each op, to check that the
bytes each bound assumes really cross the shaped link.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hybridsync.backends import waiting

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402
PATHS = ("ring", "hier", "hier-gloo", "ps")
WARMUP = 2
TINY_NUMEL = 1  # one float32: the alpha probe


# -- worker side (runs on every rank inside the emulated hosts) ------------------------------
def _tx_rx() -> tuple[int, int]:
    """This host's uplink byte counters (``ip netns exec`` mounts the namespace's own /sys)."""
    base = "/sys/class/net/eth0/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def _cpu_ticks() -> tuple[int, int]:
    """(all, idle) jiffies of the whole machine (/proc/stat is not namespaced)."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    return sum(values), values[3] + values[4]


def _ops(hvd, tensor, name: str, backends: dict) -> dict:
    from hybridsync.backends.base import Reduction
    total = Reduction(op="sum")
    return {
        "ring": lambda: backends["ring"].submit(f"{name}.ring", [tensor], total).wait(),
        "hier": lambda: backends["hier"].submit(f"{name}.hier", [tensor], total).wait(),
        "hier-gloo": lambda: backends["hier-gloo"].submit(f"{name}.hierg", [tensor], total).wait(),
        "ps": lambda: backends["ps"].submit(f"{name}.ps", [tensor], total).wait(),
    }


def _measure(hvd, numel: int, rounds: int, backends: dict, count_bytes: bool) -> dict:
    """Per path: list of this rank's seconds per round (+ rank 0's uplink bytes of one rep)."""
    import torch
    tensor = torch.empty(numel, dtype=torch.float32)
    name = f"m{numel}"
    chunks = backends["ps"].client.declare(f"{name}.ps", [tensor])  # balanced placement, before any push
    server_bytes = [0] * backends["ps"].client.config.num_servers
    for chunk in chunks:
        server_bytes[backends["ps"].client.server_of(chunk.key)] += chunk.nbytes
    assert sum(server_bytes) == tensor.nbytes, (server_bytes, tensor.nbytes)
    ops = _ops(hvd, tensor, name, backends)
    expected = float(sum(range(1, hvd.size() + 1)))
    fill = float(hvd.rank() + 1)
    for _ in range(WARMUP):
        for path in PATHS:
            tensor.fill_(fill)
            ops[path]()
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    busy: dict[str, list[float]] = {p: [] for p in PATHS}
    wire: dict[str, list[int]] = {}
    wrong = {p: 0 for p in PATHS}
    for r in range(rounds):
        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
        for path in order:
            tensor.fill_(fill)
            waiting.barrier(hvd)
            before = _tx_rx() if count_bytes and hvd.rank() == 0 else (0, 0)
            ticks = _cpu_ticks()
            start = time.perf_counter()
            ops[path]()
            seconds[path].append(time.perf_counter() - start)
            after_ticks = _cpu_ticks()
            busy[path].append(1 - (after_ticks[1] - ticks[1]) / max(1, after_ticks[0] - ticks[0]))
            if count_bytes:
                waiting.barrier(hvd)
                if hvd.rank() == 0 and path not in wire:
                    after = _tx_rx()
                    wire[path] = [after[0] - before[0], after[1] - before[1]]
            if not bool((tensor == expected).all()):  # counted, not fatal: the table says how often
                wrong[path] += 1
                print(f"rank {hvd.rank()}: {path} gave a wrong sum for {numel} elements in round {r}: "
                      f"{tensor.min().item()}..{tensor.max().item()} ({int((tensor != expected).sum())} "
                      f"elements off), expected {expected}", file=sys.stderr, flush=True)
    return {"seconds": seconds, "wire": wire, "busy": {p: statistics.median(v) for p, v in busy.items()},
            "ps_server_bytes": server_bytes, "wrong": wrong}


def _hier_stages(hvd, groups, numel: int, reps: int = 3) -> dict[str, float]:
    """Median seconds of each step of hier-gloo run on its own (this rank).

    The steps as the backend runs them; hier's cross-node step is the same as hier-gloo's, so
    hier's time less that step is what its shared-memory steps cost.
    """
    import torch
    from hybridsync.backends.hierarchical import allreduce, flat_buffers
    flat = torch.ones(numel)  # values grow with each in-place rep; only the time matters here
    shard = flat_buffers.node_slice(flat, groups.local_size, groups.local_rank)
    stages = {
        "intra all-reduce (hier-gloo)": lambda: allreduce.start_first_step(flat, groups, "st.iar").wait(),
        "cross all-reduce of slice": lambda: groups.cross_node.allreduce_async(shard, "st.ar").wait(),
        "intra all-gather (hier-gloo)": lambda: groups.intra_node.allgather(shard, "st.ag"),
    }
    out = {}
    for label, op in stages.items():
        times = []
        for _ in range(reps + 1):
            waiting.barrier(hvd)
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[label] = statistics.median(times[1:])
    return out


def worker(out_path: str, sizes_mb: list[float], rounds: int) -> None:
    import horovod.torch as hvd
    import torch

    import hybridsync as hs
    from hybridsync.backends import ps
    from hybridsync.backends.hierarchical import HierarchicalAllreduce
    from hybridsync.backends.ring import RingAllreduce

    torch.set_num_threads(1)
    hs.init()
    client = ps.init(worker_id=hvd.rank())  # on TCP: ps_env sets HYBRIDSYNC_PS_TRANSPORT=tcp
    backends = {"ring": RingAllreduce(), "hier": HierarchicalAllreduce(), "ps": ps.PSBackend(client),
                "hier-gloo": HierarchicalAllreduce(intra_node="horovod")}
    assert backends["hier"].intra_node == "shm", "the emulated hosts share /dev/shm"
    results = []
    for mb in [None, *sizes_mb]:  # None: the alpha probe
        numel = TINY_NUMEL if mb is None else int(mb * 2**20) // 4
        measured = _measure(hvd, numel, rounds if mb is not None else max(rounds, 5), backends,
                            count_bytes=mb is not None)
        gathered = hvd.allgather_object(measured["seconds"], name=f"gather{numel}")
        wrong = hvd.allgather_object(measured["wrong"], name=f"gather.wrong{numel}")
        # A rep ends when its slowest rank is done.
        slowest = {p: [max(g[p][i] for g in gathered) for i in range(len(gathered[0][p]))] for p in PATHS}
        results.append({"mb": mb, "nbytes": numel * 4, "seconds": slowest, "wire": measured["wire"],
                        "busy": measured["busy"], "wrong": {p: max(w[p] for w in wrong) for p in PATHS},
                        "ps_server_bytes": measured["ps_server_bytes"]})
    largest = int(max(sizes_mb) * 2**20) // 4
    stages = hvd.allgather_object(_hier_stages(hvd, backends["hier"].groups, largest), name="gather.stages")
    stages = {label: max(s[label] for s in stages) for label in stages[0]}
    world = {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
             "partition_bytes": client.config.partition_bytes, "num_servers": client.config.num_servers}
    waiting.barrier(hvd)
    ps.shutdown()
    if hvd.rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"world": world, "results": results, "hier_stages": {"mb": max(sizes_mb), **stages}},
                      handle)
    hvd.shutdown()


# -- bounds and report ----------------------------------------------------------------------
def cross_bytes(path: str, nbytes: int, *, nodes: int, per_node: int, server_bytes: list[int]) -> float:
    """Bytes one host's uplink carries in one direction for one op (the larger direction/host)."""
    n = nodes * per_node
    if path == "ring":
        return 2 * (n - 1) / n * nbytes
    if path.startswith("hier"):
        return 2 * (nodes - 1) / nodes * nbytes
    # ps: servers host-major, len(server_bytes) // nodes per host; every worker pushes and
    # pulls each key once. Out of host h: pushes of its workers to remote keys + pulls of
    # its keys by remote workers.
    per_host = len(server_bytes) // nodes
    local = [sum(server_bytes[h * per_host:(h + 1) * per_host]) for h in range(nodes)]
    return max(per_node * (nbytes - local[h]) + (n - per_node) * local[h] for h in range(nodes))


def report(data: dict, *, bytes_per_second: float, measured_bps: float, rate: str) -> str:
    world = data["world"]
    nodes, per_node = world["cross_size"], world["local_size"]
    rows = data["results"]
    alpha = {p: statistics.median(rows[0]["seconds"][p]) for p in PATHS}
    rounds = len(rows[-1]["seconds"]["ring"])
    lines = [
        f"{nodes} hosts x {per_node} ranks (Horovod Gloo) + {world['num_servers']} PS servers (1 per host), "
        f"uplink {rate} = {bytes_per_second / 1e6:.0f} MB/s each way "
        f"(measured TCP goodput {measured_bps / 1e6:.0f} Mbit/s = {measured_bps / 8e6:.1f} MB/s); "
        f"PS keys of {world['partition_bytes'] / 2**20:g} MiB; median of {rounds} interleaved rounds, "
        f"slowest rank per rep",
        "bounds: ring 2(n-1)/n*S/B (n=4) = 1.5 S/B; hier 2(N-1)/N*S/B (N=2 nodes) = S/B; "
        "ps 2w(N-1)/N*S/B (w=2 workers/host, colocated servers, balanced keys) = 2 S/B; alpha left out",
        f"alpha (4-byte message, median): " + ", ".join(f"{p} {alpha[p] * 1e3:.2f} ms" for p in PATHS),
        "",
        f"{'path':<9} {'size':>6} {'measured s':>11} {'bound s':>9} {'bound/meas':>11} {'(bound+a)/meas':>15} "
        f"{'uplink MB model':>16} {'host0 tx/rx MB':>15} {'CPU busy':>9} {'wrong sums':>11}",
    ]
    for row in rows[1:]:
        for path in PATHS:
            measured = statistics.median(row["seconds"][path])
            model_bytes = cross_bytes(path, row["nbytes"], nodes=nodes, per_node=per_node,
                                      server_bytes=row["ps_server_bytes"])
            bound = model_bytes / bytes_per_second
            tx, rx = row["wire"].get(path, [0, 0])
            lines.append(
                f"{path:<9} {row['mb']:>4g}MB {measured:>11.3f} {bound:>9.3f} {bound / measured:>10.0%} "
                f"{(bound + alpha[path]) / measured:>14.0%} {model_bytes / 1e6:>16.1f} "
                f"{tx / 1e6:>7.1f}/{rx / 1e6:<7.1f} {row['busy'][path]:>8.0%} "
                f"{row['wrong'][path]:>5}/{len(row['seconds'][path])}")
    largest = rows[-1]
    verdict = {p: cross_bytes(p, largest["nbytes"], nodes=nodes, per_node=per_node,
                              server_bytes=largest["ps_server_bytes"]) / bytes_per_second
               / statistics.median(largest["seconds"][p]) for p in PATHS}
    lines += ["", f"target >= 80% of bound at {largest['mb']:g} MB: " + ", ".join(
        f"{p} {v:.0%} {'met' if v >= 0.8 else 'MISSED'}" for p, v in verdict.items())]
    stages = dict(data["hier_stages"])
    size = stages.pop("mb")
    lines += ["", f"hierarchical all-reduce step by step at {size:g} MB (each step alone, slowest rank, median):"]
    lines += [f"  {label:<36} {seconds:.3f} s" for label, seconds in stages.items()]
    lines.append(f"load average (1 min) before/after: {data['load'][0]:.1f}/{data['load'][1]:.1f} "
                 f"on {os.cpu_count()} CPUs")
    return "\n".join(lines)


# -- controller (root, outside the namespaces) -------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="1gbit", help="tc-style uplink rate (default 1gbit)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64], help="message sizes in MiB")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per size (default 7)")
    parser.add_argument("--partition-mb", type=float, default=2.0,
                        help="PS key size in MiB (BYTEPS_PARTITION_BYTES); 2 MiB splits every size evenly")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds before the job is killed")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    from hybridsync.run.emulated import launch_gloo, launch_servers, ps_env
    from hybridsync.cluster.linkrate import measure_tcp_rate

    print_header()
    spec = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth=args.bandwidth, servers_per_node=1)
    logs = tempfile.mkdtemp(prefix="hs-collectives-")
    out_path = os.path.join(logs, "results.json")
    load_before = os.getloadavg()[0]
    with EmulatedCluster(spec) as cluster:
        link = measure_tcp_rate(cluster, src=0, dst=1, nbytes=int(spec.inter_node_bytes_per_second * 0.4))
        env = {**os.environ, **ps_env(cluster), "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
               "BYTEPS_PARTITION_BYTES": str(int(args.partition_mb * 2**20)),
               "TP_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        # Files, not pipes: a chatty process cannot block on a full pipe. Appends interleave.
        server_log = open(os.path.join(logs, "servers.log"), "a")
        rank_log = open(os.path.join(logs, "ranks.log"), "a")
        try:
            servers = launch_servers(cluster, env=env, stdout=server_log, stderr=subprocess.STDOUT)
            command = [sys.executable, os.path.abspath(__file__), "--worker", out_path,
                       str(args.rounds), *map(str, args.sizes)]
            job = launch_gloo(cluster, command, env=env, stdout=rank_log, stderr=subprocess.STDOUT)
            try:
                codes, why = job.wait(timeout=args.timeout), ""
            except TimeoutError as error:
                codes, why = None, str(error)
            try:
                servers.wait(timeout=30)  # they exit once every worker said goodbye
            except TimeoutError:
                pass
        finally:
            server_log.close()
            rank_log.close()
    if codes is None or any(codes) or not os.path.exists(out_path):
        print(f"benchmark job failed: exit codes {codes} {why}")
        for name in sorted(os.listdir(logs)):
            with open(os.path.join(logs, name), errors="replace") as handle:
                text = handle.read()
            if name.endswith(".log") and text.strip():
                print(f"--- {name} (tail) ---\n{text[-3000:]}")
        print(f"logs kept in {logs}")
        return 1
    with open(out_path) as handle:
        data = {**json.load(handle), "load": [load_before, os.getloadavg()[0]]}
    shutil.rmtree(logs, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({**data, "link_bits_per_second": link.bits_per_second}, handle, indent=1)
    print(report(data, bytes_per_second=spec.inter_node_bytes_per_second, measured_bps=link.bits_per_second,
                 rate=args.bandwidth))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], [float(s) for s in sys.argv[4:]], int(sys.argv[3]))
    else:
        sys.exit(main())
